"""``plait bench tp``, DLRM part: plait's sharded embedding bags against TorchRec's.

The same T tables (same initial weights), sharded table-wise over the ranks by
both: plait's :class:`~plait.nn.ShardedEmbeddingBag` (fused
``embedding_all_to_all``, and its plain path) and TorchRec's sharded
``EmbeddingBagCollection`` (``DistributedModelParallel`` with a table-wise
plan; FBGEMM's CPU TBE kernel). Each step: pool every table's bags, hand every
rank its slice of the batch, a mean-squared loss against a fixed synthetic
target, backward, exact SGD with the same learning rate (TorchRec fuses it into
the backward, as it does in production; plait's tables take ``torch.optim.SGD``).

What differs in the work, by design of each library: plait's layer takes the
whole batch's ids on every rank (the DLRM's input is replicated) and sends
only pooled rows; TorchRec takes each rank's own slice of the batch and first
sends the ids to the tables' owners (an all-to-all of ``B·pool`` ids, 8 bytes
each, besides the pooled rows). plait's backward makes dense table gradients;
TorchRec's updates the touched rows only.

TorchRec is optional: without it (or with a build that does not load) plait's
two paths still run, each the other's loss reference, and the caller records
why TorchRec did not.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..ops import explain
from ..ops.pieces import even_sizes
from ..runtime import rank_context
from ..runtime.timing import agreed_max, balanced_round, median, time_once
from ..training.loop import Trainer
from ..training.models import make_optimizer
from .config.tp import EmbBenchConfig

__all__ = ["EmbBenchConfig", "EMB_SYSTEMS", "PLAIT_EMB_SYSTEMS", "torchrec_missing",
           "initial_tables", "batch_slice", "run_emb_bench"]

EMB_SYSTEMS = ("plait-emb", "plait-emb-plain", "torchrec")
PLAIT_EMB_SYSTEMS = EMB_SYSTEMS[:2]  # what runs where TorchRec does not
NOTES = {
    "plait-emb": "ShardedEmbeddingBag, fused embedding_all_to_all; whole-batch ids on every rank; "
                 "dense table gradients, torch.optim.SGD",
    "plait-emb-plain": "ShardedEmbeddingBag(overlap=False): pool everything, then one all_to_all",
    "torchrec": "DistributedModelParallel, table-wise plan, FBGEMM CPU TBE with EXACT_SGD fused "
                "into the backward (lr × world: TorchRec averages sparse gradients over ranks); "
                "each rank's own bags, ids sent to the owners by an all-to-all first",
}


def torchrec_missing() -> str | None:
    """None if TorchRec and its FBGEMM kernels import here, else the error, one line."""
    try:
        with warnings.catch_warnings():  # FBGEMM's notes on its optional SSD kernels
            warnings.simplefilter("ignore")
            import torchrec  # noqa: F401
            from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from an FBGEMM built for another torch
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _torchrec_tables(cfg: EmbBenchConfig, full: list[torch.Tensor]) -> nn.Module:
    """TorchRec's EmbeddingBagCollection, table-wise over all ranks, loaded with ``full``."""
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType

    for name in ("torchrec", "torch.fx._symbolic_trace"):  # dry-run planner notes, per rank
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torchrec")
    configs = [torchrec.EmbeddingBagConfig(name=f"t{t}", embedding_dim=cfg.dim,
                                           num_embeddings=cfg.rows, feature_names=[f"f{t}"])
               for t in range(cfg.tables)]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    # TorchRec follows DDP's convention: each rank's loss is its own and the sparse gradients
    # are averaged over the ranks (scaled by 1/world; measured: its updates are exactly
    # plait's at world × lr). plait's loss is the sum of the ranks' losses, so the same
    # update needs lr × world here.
    lr = cfg.lr * dist.get_world_size()
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                          "learning_rate": lr})
    only_tw = {c.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])
               for c in configs}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=dist.get_world_size(),
                                                         compute_device="cpu"),
                                       constraints=only_tw)
    plan = planner.collective_plan(ebc, [sharder], dist.group.WORLD)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan,
                                     sharders=[sharder], init_data_parallel=False)
    with torch.no_grad():  # DMP initialises its own weights: overwrite them with ours
        for lookup in model.module._lookups:
            for emb in lookup._emb_modules:
                for w, c in zip(emb.split_embedding_weights(), emb.config.embedding_tables):
                    w.copy_(full[int(c.name[1:])])
    return model


def initial_tables(cfg: EmbBenchConfig) -> list[torch.Tensor]:
    """The T tables' initial weights, the same on every rank and for every system."""
    gen = torch.Generator().manual_seed(cfg.seed)
    return [torch.empty(cfg.rows, cfg.dim).uniform_(-cfg.rows ** -0.5, cfg.rows ** -0.5,
                                                    generator=gen)
            for _ in range(cfg.tables)]


def batch_slice(batch: int, world: int, rank: int) -> slice:
    """Rank ``rank``'s bags of the batch: where plait's layer leaves them (its default,
    even split, larger shares first), so the target and TorchRec's input agree with it."""
    sizes = even_sizes(batch, world)
    lo = sum(sizes[:rank])
    return slice(lo, lo + sizes[rank])


def _batches(cfg: EmbBenchConfig, steps: int) -> list[tuple]:
    """Random bags; the target is what fixed "teacher" tables pool for them, so the loss can fall."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    teacher = [torch.randn(cfg.rows, cfg.dim, generator=gen) * cfg.pool ** -0.5  # target ~ N(0, 1)
               for _ in range(cfg.tables)]
    offsets = torch.arange(0, cfg.batch * cfg.pool, cfg.pool)
    out = []
    for _ in range(steps):
        ids = [torch.randint(0, cfg.rows, (cfg.batch * cfg.pool,), generator=gen)
               for _ in range(cfg.tables)]
        target = torch.stack([F.embedding_bag(i, w, offsets, mode="sum")
                              for i, w in zip(ids, teacher)], dim=1)
        out.append((ids, target))  # [B, T, D]
    return out


def _mse(out: torch.Tensor, target_r: torch.Tensor, cfg: EmbBenchConfig) -> torch.Tensor:
    """This rank's share of the whole batch's mean-squared error (the ranks' shares sum to it)."""
    return ((out - target_r) ** 2).sum() / (cfg.batch * cfg.tables * cfg.dim)


class _Plait:
    def __init__(self, cfg: EmbBenchConfig, full: list[torch.Tensor], overlap: bool):
        from ..models.dlrm import EmbeddingBagCollection
        from ..nn import ShardedEmbeddingBag

        plain = EmbeddingBagCollection([cfg.rows] * cfg.tables, cfg.dim)
        with torch.no_grad():
            for bag, w in zip(plain.bags, full):
                bag.weight.copy_(w)
        self.cfg = cfg
        tables = ShardedEmbeddingBag.from_module(plain, overlap=overlap, chunks=cfg.chunks)
        self.trainer = Trainer(tables, make_optimizer(tables, cfg.lr, "sgd"), self._loss)
        self.offsets = [torch.arange(0, cfg.batch * cfg.pool, cfg.pool)] * cfg.tables
        self.path = ""

    def _loss(self, tables: nn.Module, batch) -> torch.Tensor:
        ids, target_r = batch
        out = tables(ids, self.offsets)  # [B_r, T, D]
        self.path = explain("embedding_all_to_all")  # this call's path (fused or not, and why)
        return _mse(out, target_r, self.cfg)

    def step(self, ids, target_r) -> torch.Tensor:
        # the loss as the tensor it was (the tables' dtype: the record's float holds it exactly)
        dtype = next(self.trainer.model.parameters()).dtype
        return torch.tensor(self.trainer.step(0, (ids, target_r))["loss"], dtype=dtype)


class _TorchRec:
    def __init__(self, cfg: EmbBenchConfig, full: list[torch.Tensor]):
        import torchrec

        self.cfg, self.model, self.kjt = cfg, _torchrec_tables(cfg, full), torchrec.KeyedJaggedTensor
        own = batch_slice(cfg.batch, dist.get_world_size(), dist.get_rank())
        self.lo, self.hi = own.start, own.stop

    def step(self, ids, target_r) -> torch.Tensor:
        cfg, lo, hi = self.cfg, self.lo, self.hi
        values = torch.cat([i[lo * cfg.pool: hi * cfg.pool] for i in ids])  # key-major, own bags
        kjt = self.kjt.from_lengths_sync(keys=[f"f{t}" for t in range(cfg.tables)], values=values,
                                         lengths=torch.full(((hi - lo) * cfg.tables,), cfg.pool))
        pooled = self.model(kjt)
        pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
        by_key = pooled.to_dict()  # its keys come in shard order, not table order
        out = torch.stack([by_key[f"f{t}"] for t in range(cfg.tables)], dim=1)  # [B_r, T, D]
        loss = _mse(out, target_r, cfg)
        loss.backward()  # the fused TBE applies SGD to the touched rows here
        return loss.detach()


def run_emb_bench(cfg: EmbBenchConfig, warmup: int, steps: int, compare_steps: int,
                  systems: tuple[str, ...] = EMB_SYSTEMS) -> list[dict]:
    """On every rank: ``systems`` (all three, or plait's two where TorchRec does not
    import), steps interleaved; one record each."""
    ctx, world, rank = rank_context(), dist.get_world_size(), dist.get_rank()
    if cfg.tables % world:
        raise ValueError(f"{cfg.tables} tables do not split evenly over {world} ranks")
    unknown = [s for s in systems if s not in EMB_SYSTEMS]
    if unknown or not systems:
        raise ValueError(f"DLRM systems {list(systems)}: choose from {list(EMB_SYSTEMS)}")
    full = initial_tables(cfg)
    build = {"plait-emb": lambda: _Plait(cfg, full, True),
             "plait-emb-plain": lambda: _Plait(cfg, full, False),
             "torchrec": lambda: _TorchRec(cfg, full)}
    built = {name: build[name]() for name in systems}
    own = batch_slice(cfg.batch, world, rank)
    losses = {n: [] for n in built}
    times = {n: [] for n in built}
    names = list(built)
    for i, (ids, target) in enumerate(_batches(cfg, warmup + steps)):
        for name in balanced_round(names, i):  # no system always first, or after the same one
            system = built[name]
            out = {}
            step = lambda: out.setdefault("loss", system.step(ids, target[own]))  # noqa: E731
            times[name].append(time_once(step))
            dist.all_reduce(out["loss"])  # outside the timed step: the global mean, for the record
            losses[name].append(float(out["loss"]))
        ctx.report({"step": i, "of": warmup + steps, "part": "dlrm"})
    records = [_emb_record(n, cfg, losses, agreed_max(times[n]), warmup, compare_steps)
               for n in built]
    for r in records:
        if isinstance(built[r["system"]], _Plait):
            r["path"] = built[r["system"]].path
    return records


def _loss_reference(name: str, ran) -> str | None:
    """Whose losses ``name``'s are compared with: TorchRec where it ran (for TorchRec,
    plait-emb); else each of plait's two paths the other's."""
    return next((ref for ref in ("torchrec", "plait-emb", "plait-emb-plain")
                 if ref != name and ref in ran), None)


def _emb_record(name, cfg, losses, step_s, warmup, compare_steps) -> dict:
    ref = _loss_reference(name, losses)
    n = min(compare_steps, len(step_s))
    t_step = median(step_s[warmup:])
    return {"system": name, "t_step_s": t_step, "tokens_per_s": cfg.batch / t_step,
            "unit": "samples", "max_loss_diff": None if ref is None else max(
                abs(a - b) for a, b in zip(losses[name][:n], losses[ref][:n])),
            "loss_diff_vs": ref, "compare_steps": n, "losses": losses[name],
            "step_times_s": step_s, "model": {"tables": cfg.tables, "rows": cfg.rows,
                                              "dim": cfg.dim, "batch": cfg.batch,
                                              "pool": cfg.pool},
            "optimizer": "sgd (exact)", "lr": cfg.lr, "world_size": dist.get_world_size(),
            "note": NOTES[name], "link": rank_context().link, "part": "dlrm"}
