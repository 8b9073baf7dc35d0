"""Exact migration beyond one move: a tensor-parallel float64 GPT (2 blocks, 12 heads of 4,
192 MLP columns) trained with AdamW (amsgrad) on 3 and 4 ranks computes what the same GPT in
one process computes, through

- several migrations of each block's dims (heads; MLP columns), the first before the optimizer
  holds any state, two on consecutive steps, and the return to the even plan (plain path);
- a migration of other dims while one dim is ZERO-resized (it stays resized, the same
  features), then of the resized dim itself (its resizing ends) (fused path);
- gradient accumulation across a migration: two backward passes per step, the model moved
  between them, on the fused path with two interleaved micro-batches (``microbatches=2``),
  whose row-parallel weight gradients are deferred (they are in ``.grad`` when the backward
  returns, so none is pending when the move comes).

While a dim is resized, the reference computes with the skipped features' weights masked to
zero, so it gets the zero (imputed) gradients there that the resized layers give.

Compared: each step's loss (each backward pass's), to 1e-12 (~1e-15 seen); right after each
migration and after training, every gradient and optimizer-state tensor gathered whole, to
1e-12 of the tensor's largest entry (~1e-14 seen: only the order of the row-parallel sums
differs), and every weight to 1e-12 of the larger of 1 and its largest entry (~3e-14 seen;
relative to a small weight tensor's own largest entry up to 4e-13 is seen: Adam divides by
sqrt(v) + eps, so an element whose gradient is near eps, a sum of terms that cancel, carries
its rounding up).
One launch per world size runs all three.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call

from plait.balance import migrate
from plait.models import GPT, GPTConfig
from plait.nn import ShardPlan
from plait.parallel import apply_tp
from plait.ops.deferred import pending
from plait.testing import run_ranks

TOL = 1e-12
HEADS, COLUMNS = 12, 192
STEPS = 5


def _uneven(total, world, turn):
    """A lopsided plan that differs with ``turn``: rank r weighs (r + turn) mod world + 1."""
    return ShardPlan.proportional(total, [(r + turn) % world + 1 for r in range(world)])


def _plans(world, turn, dims=("blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp")):
    """{layer name: plan} for ``dims``: ``turn`` None is the even plan, else ``_uneven``."""
    out = {}
    for i, dim in enumerate(dims):
        total = HEADS if dim.endswith("attn") else COLUMNS
        plan = ShardPlan.even(total, world) if turn is None else _uneven(total, world, turn + i)
        layers = ("qkv", "proj") if dim.endswith("attn") else ("fc", "proj")
        out.update({f"{dim}.{layer}": plan for layer in layers})
    return out


def _batches(steps, rows):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 32, (rows, 8), generator=gen),
             torch.randint(0, 32, (rows, 8), generator=gen)) for _ in range(steps)]


def _models(**tp):
    torch.manual_seed(0)
    # no biases: the key bias's gradient is zero in exact arithmetic (softmax does not see a
    # shift shared by all keys), so it is rounding noise that Adam scales up to ~1e-13 steps,
    # different in each summation order (biases migrate in test_migrate.py)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=HEADS, n_embd=48, bias=False)
    ref = GPT(cfg).double()
    model = apply_tp(copy.deepcopy(ref), chunks=2, **tp)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True)

    return model, adamw(model.parameters()), ref, adamw(ref.parameters())


def _errors(model, opt, ref, ref_opt, when, out):
    """Into ``out``: per tensor, |TP − reference| over the reference's largest entry (at least 1
    for a weight), for every parameter, its gradient and each optimizer-state tensor, gathered
    whole (a collective)."""
    ref_params = dict(ref.named_parameters())
    for mname, module in model.named_modules():
        for key, p in module.named_parameters(recurse=False):
            name = f"{mname}.{key}"
            whole = (lambda t, m=module, k=key: m.gather_like(k, t)) \
                if hasattr(module, "gather_like") else (lambda t: t.detach())
            rp = ref_params[name]
            assert (p.grad is None) == (rp.grad is None), (when, name)
            pairs = {name: (whole(p), rp)}
            if p.grad is not None:
                pairs[f"{name}.grad"] = (whole(p.grad), rp.grad)
            state, ref_state = opt.state[p], ref_opt.state[rp]
            assert sorted(state) == sorted(ref_state), (when, name, sorted(state))
            for k, v in state.items():
                pairs[f"{name}.{k}"] = (whole(v) if v.dim() else v, ref_state[k])
            for what, (got, want) in pairs.items():
                assert got.shape == want.shape, (when, what, got.shape, want.shape)
                scale = max(float(want.detach().abs().max()), 1.0 if what == name else 1e-30)
                out[f"{when}: {what}"] = float((got - want).detach().abs().max()) / scale


def _step(opt):
    """One optimizer step on the gradients the backward passes since the last one summed."""
    opt.step()
    opt.zero_grad()


def _moves_and_back(world):
    """Plain path: moves before the first step, at steps 2 and 3, and back to even at 4."""
    model, opt, ref, ref_opt = _models(overlap=False)
    moves = {0: _plans(world, 0), 2: _plans(world, 1, ("blocks.0.attn", "blocks.1.mlp")),
             3: _plans(world, 2, ("blocks.0.mlp", "blocks.1.attn")), 4: _plans(world, None)}
    errors, loss_err = {}, 0.0
    for step, (idx, targets) in enumerate(_batches(STEPS, 4)):
        if step in moves:
            migrate(model, opt, moves[step])
            _errors(model, opt, ref, ref_opt, f"after move {step}", errors)
        loss, ref_loss = model(idx, targets)[1], ref(idx, targets)[1]
        for o, lo in ((opt, loss), (ref_opt, ref_loss)):
            lo.backward()
            _step(o)
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()))
    _errors(model, opt, ref, ref_opt, "end", errors)
    sizes = [layer.plan.sizes for layer in (model.blocks[0].attn.qkv, model.blocks[1].mlp.fc)]
    return loss_err, errors, sizes == [ShardPlan.even(HEADS, world).sizes,
                                       ShardPlan.even(COLUMNS, world).sizes]


def _kept(plan, rank):
    """Which of its MLP features rank ``rank`` keeps while resized: every other one on odd
    ranks, all on even ranks (None)."""
    return torch.arange(0, plan.sizes[rank], 2) if rank % 2 else None


def _mask(plan, world):
    """The reference's 0/1 mask over the MLP's columns: the features no rank computes are 0."""
    mask = torch.ones(COLUMNS, dtype=torch.float64)
    for r in range(world):
        kept = _kept(plan, r)
        if kept is not None:
            skipped = sorted(set(range(plan.sizes[r])) - set(kept.tolist()))
            mask[[plan.start_of(r) + k for k in skipped]] = 0
    return mask


def _masked_loss(ref, batch, mask):
    """The reference's loss with block 0's MLP columns outside ``mask`` skipped."""
    if mask is None:
        return ref(*batch)[1]
    fc, proj = ref.blocks[0].mlp.fc, ref.blocks[0].mlp.proj
    masked = {"blocks.0.mlp.fc.weight": fc.weight * mask[:, None],
              "blocks.0.mlp.proj.weight": proj.weight * mask[None, :]}
    return functional_call(ref, masked, batch)[1]


def _moves_while_resized(world):
    """Fused path: block 0's MLP resized from step 1; block 0's heads and block 1's MLP migrate
    at step 2 (block 0's MLP stays resized); block 0's MLP migrates at step 4 (resizing ends)."""
    rank = dist.get_rank()
    model, opt, ref, ref_opt = _models(overlap=True)
    fc, proj = model.blocks[0].mlp.fc, model.blocks[0].mlp.proj
    errors, loss_err, mask, keeps = {}, 0.0, None, []
    for step, batch in enumerate(_batches(STEPS, 4)):
        if step == 1:
            kept = _kept(fc.plan, rank)
            if kept is not None:
                for layer in (fc, proj):
                    layer.resize(len(kept) / fc.plan.sizes[rank], kept=kept)
            mask = _mask(fc.plan, world)
        if step == 2:
            migrate(model, opt, _plans(world, 0, ("blocks.0.attn", "blocks.1.mlp")))
            _errors(model, opt, ref, ref_opt, "after move 2", errors)
        if step == 4:
            migrate(model, opt, _plans(world, 1, ("blocks.0.mlp",)))
            _errors(model, opt, ref, ref_opt, "after move 4", errors)
            mask = None
        keeps.append((fc.keep, proj.keep))
        loss, ref_loss = model(*batch)[1], _masked_loss(ref, batch, mask)
        for o, lo in ((opt, loss), (ref_opt, ref_loss)):
            lo.backward()
            _step(o)
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()))
    _errors(model, opt, ref, ref_opt, "end", errors)
    return loss_err, errors, keeps


def _accumulation_across_a_move(world):
    """Fused, two interleaved micro-batches per forward; each step two backward passes (half
    the batch each) whose gradients add up, the model migrated between them at steps 1 and 3."""
    model, opt, ref, ref_opt = _models(overlap=True, microbatches=2)
    moves = {1: _plans(world, 0), 3: _plans(world, 1)}
    errors, loss_err, left = {}, 0.0, []
    for step, (idx, targets) in enumerate(_batches(STEPS, 8)):
        for half in (slice(0, 4), slice(4, 8)):
            if half.start and step in moves:
                left.append(pending())  # deferred weight gradients not yet in .grad
                migrate(model, opt, moves[step])
                _errors(model, opt, ref, ref_opt, f"after move {step}", errors)
            loss = model(idx[half], targets[half])[1] / 2
            ref_loss = ref(idx[half], targets[half])[1] / 2
            loss.backward()
            ref_loss.backward()
            loss_err = max(loss_err, abs(loss.item() - ref_loss.item()))
        _step(opt)
        _step(ref_opt)
    _errors(model, opt, ref, ref_opt, "end", errors)
    return loss_err, errors, left


def _all_cases():
    world = dist.get_world_size()
    return {"moves and back to even": _moves_and_back(world),
            "moves while resized": _moves_while_resized(world),
            "accumulation across a move": _accumulation_across_a_move(world)}


def _check(case, loss_err, errors):
    assert loss_err <= TOL, (case, loss_err)
    assert any(k.startswith("after move") for k in errors) and any(
        k.startswith("end") for k in errors), (case, sorted(errors)[:3])
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, (case, worst, errors[worst])


@pytest.mark.parametrize("world", [3, 4])
def test_training_through_migrations_equals_one_process(world):
    results = run_ranks(_all_cases, world)
    for rank, cases in enumerate(results):
        loss_err, errors, back_to_even = cases["moves and back to even"]
        _check((rank, "moves and back to even"), loss_err, errors)
        assert back_to_even, rank

        loss_err, errors, keeps = cases["moves while resized"]
        _check((rank, "moves while resized"), loss_err, errors)
        # odd ranks resized at step 1, still after the other dims moved at 2, not after 4
        resized = rank % 2 == 1
        assert [k[0] < 1.0 for k in keeps] == [False, resized, resized, resized, False]
        assert all(a == b for a, b in keeps), keeps  # fc and proj skip the same features

        loss_err, errors, left = cases["accumulation across a move"]
        _check((rank, "accumulation across a move"), loss_err, errors)
        assert left == [0, 0], left
