"""What the checkpoint tests share: a float64 GPT with uneven heads and MLP columns, a few
AdamW steps, and every parameter and optimizer-state tensor gathered whole."""

import copy

import torch
import torch.distributed as dist

from plait.balance import migrate
from plait.models import GPT, GPTConfig
from plait.nn import ShardPlan
from plait.parallel import apply_tp

# 10 heads of 4 (n_embd 40), MLP 160 columns: uneven on 3 ranks as [3, 5, 2] heads and
# [48, 80, 32] columns (the 30/50/20 split of the issue's [300, 500, 200])
CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=10, n_embd=40, bias=True)
UNEVEN = {"heads": ShardPlan((3, 5, 2)), "mlp": ShardPlan((48, 80, 32))}


def build(seed=0, plans=None, cfg=CFG):
    """The GPT of ``seed``, tensor-parallel (plait's layers) when torch.distributed is up."""
    torch.manual_seed(seed)
    model = GPT(cfg).double()
    model = apply_tp(model, plans=plans, overlap=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batches(steps, rows=4):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 32, (rows, 8), generator=gen),
             torch.randint(0, 32, (rows, 8), generator=gen)) for _ in range(steps)]


def train(model, opt, steps):
    for idx, targets in batches(steps):
        model(idx, targets)[1].backward()
        opt.step()
        opt.zero_grad()


def trained_uneven():
    """On 3 ranks: even plans for one step, then migrated (the balancer's move) to the
    uneven ones, and two more steps: the shards and the optimizer state are uneven."""
    model, opt = build()
    train(model, opt, 1)
    plans = {}
    for i in range(CFG.n_layer):
        plans.update({f"blocks.{i}.attn.qkv": UNEVEN["heads"],
                      f"blocks.{i}.attn.proj": UNEVEN["heads"],
                      f"blocks.{i}.mlp.fc": UNEVEN["mlp"], f"blocks.{i}.mlp.proj": UNEVEN["mlp"]})
    migrate(model, opt, plans)
    train(model, opt, 2)
    return model, opt


def full(model, opt):
    """Every parameter and each of its optimizer-state tensors, whole (a collective)."""
    out = {}
    for mname, module in model.named_modules():
        for key, p in module.named_parameters(recurse=False):
            name = f"{mname}.{key}" if mname else key
            whole = (lambda t, m=module, k=key: m.gather_like(k, t)) \
                if hasattr(module, "gather_like") else (lambda t: t.detach().clone())
            out[name] = whole(p)
            for k, v in opt.state.get(p, {}).items():
                out[f"{name}.{k}"] = whole(v) if v.dim() else v.detach().clone()
    return out


def plain_full(model, opt):
    """``full`` of a single-process model."""
    return {**{k: p.detach().clone() for k, p in model.named_parameters()},
            **{f"{k}.{s}": v.detach().clone() for k, p in model.named_parameters()
               for s, v in opt.state.get(p, {}).items()}}


def dp_tp(kind, seed, plans=None):
    """The GPT of ``seed`` on ``dp_tp_mesh(2, 2)`` (4 ranks): plait-TP on each tp group
    (``plans``: None, even), data-parallel over dp by ``kind`` ("fsdp" or "ddp")."""
    from plait.parallel import data_parallel, dp_tp_mesh

    mesh = dp_tp_mesh(2, 2)
    torch.manual_seed(seed)
    tp_model = apply_tp(GPT(CFG).double(), mesh.get_group("tp"), plans=plans, overlap=False)
    model = data_parallel(tp_model, mesh, kind=kind)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def whole(model, opt):
    """Every parameter and each of its optimizer-state tensors, gathered over dp (an FSDP2
    DTensor's ``full_tensor``) and then over tp (the plait layer's ``gather_like``); a
    model that is not data-parallel: ``full``."""
    from torch.distributed.tensor import DTensor

    def tp_local(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    out = {}
    for mname, module in getattr(model, "module", model).named_modules():
        for key, p in module.named_parameters(recurse=False):
            name = f"{mname}.{key}" if mname else key
            whole_of = (lambda t, m=module, k=key: m.gather_like(k, tp_local(t))) \
                if hasattr(module, "gather_like") else tp_local
            out[name] = whole_of(p)
            for k, v in opt.state.get(p, {}).items():
                out[f"{name}.{k}"] = whole_of(v) if v.dim() else v.detach().clone()
    return out


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def same(a, b):
    """Names whose tensors differ in shape, dtype or any bit (both dicts must match)."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:5]
    return [k for k in a if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype
            or not torch.equal(a[k], b[k])]


__all__ = ["CFG", "UNEVEN", "build", "batches", "train", "trained_uneven", "full",
           "plain_full", "dp_tp", "whole", "rank", "same", "copy"]
