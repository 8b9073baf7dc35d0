"""``plait train --dp N --tp M`` and ``--balance POLICY``: what the training loop adds per rank.

Data × tensor parallelism: ``N × M`` ranks on a ``("dp", "tp")`` DeviceMesh
(:class:`plait.parallel.MeshLayout`; ``--tp-across-hosts`` for the other
placement). The model is made tensor-parallel on the rank's tp group by the
same builder as before (``apply_tp`` for the GPT, ``plait.parallelize`` for
the transformers models), then data-parallel over dp by PyTorch
(``plait.parallel.data_parallel``: FSDP2 or DDP, whichever sees every
gradient). Every rank draws the same global batch; replica ``d`` keeps rows
``[d·B/N, (d+1)·B/N)``. The logged loss is the replicas' mean: the rows are
equal in number and length, so it is the global batch's mean loss.

Balancing: ``plait.balance.Balancer`` (the API ``bench hetero``'s ``BalancedRun``
drives) steps after every optimizer step; its time is added to the step's
time (as ``BalancedRun`` times it), its decisions go into the step's record and
the run's result. With ``dp > 1`` data parallelism needs every replica in a tp position to
hold the same shapes, so the plans are agreed across dp: the balancer runs on each rank's tp
group with its dp group beside it, every speed reading is its tp position's slowest
replica's (``plait.balance.balancer.ReplicaMonitor``), and every replica takes the same
decisions. After a migration DDP's reducer is rebuilt for the new shapes
(``plait.parallel.data.replanned``, which checks the replicas first). A balanced run with
``dp > 1`` is data-parallel by DDP: FSDP2's sharding is not rebuilt after a migration. DDP
does not see the weight gradients fused row-parallel layers add outside autograd, so it
needs ``--no-overlap`` unless ``--sequence-parallel`` (refused in one line).

The capacity ideal (``plait.train_report.capacity_ideal``), with or without a balancer: a
:class:`StepTally` times every plait layer's compute regions beside the balancer's monitor
and closes each step's figures after the step (outside its time); ``report`` gathers them
from every rank into the step records and computes the ideal.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch
import torch.distributed as dist

from .parallel.data import MeshLayout

__all__ = ["BALANCE", "DP_MODELS", "BALANCED_MODELS", "mesh_layout", "check_parallel",
           "placement_line", "RankParallel", "StepTally"]

BALANCE = ("even", "resize", "migrate", "semi")
DP_MODELS = ("gpt", "hf-llama")
"""Models ``--dp`` above 1 is tested with (loss against one process on the global batch)."""
BALANCED_MODELS = ("gpt", "hf-llama")
"""Models whose sharded dims (attention heads, MLP columns) the balancer moves."""
# the balancer's settings for a shared machine, the values bench hetero uses by default
EVERY, REFRESH, CONFIRM_STEPS, SPIKE_STEPS = 2, 200, 3, 12


def mesh_layout(cfg, ranks: int) -> MeshLayout:
    """The ``dp × tp`` layout of ``cfg`` on ``ranks`` ranks (``--tp`` unset: ranks / dp), or
    ValueError in one line when the product is not ``ranks``."""
    dp = cfg.dp
    if cfg.tp is None and ranks % dp:
        raise ValueError(f"--dp {dp} does not divide {ranks} ranks")
    tp = cfg.tp if cfg.tp is not None else ranks // dp
    if dp * tp != ranks:
        raise ValueError(f"--dp {dp} × --tp {tp} = {dp * tp} ranks, but the run has {ranks} "
                         "(--ranks, or --hosts)")
    return MeshLayout(dp=dp, tp=tp, tp_inside_host=not cfg.tp_across_hosts)


def check_parallel(cfg) -> None:
    """Refuse, in one line, what ``--dp``, ``--tp``, ``--tp-across-hosts`` and ``--balance``
    cannot do with the rest of ``cfg`` (called from ``TrainConfig.__post_init__``)."""
    for name in ("dp", "tp"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be positive, got {value}")
    if cfg.balance not in BALANCE:
        raise ValueError(f"--balance must be one of {', '.join(BALANCE)}, got {cfg.balance!r}")
    if cfg.dp > 1 and cfg.model not in DP_MODELS:
        raise ValueError(f"--dp {cfg.dp} applies to --model {' and '.join(DP_MODELS)}, not to "
                         f"{cfg.model}")
    if cfg.dp > 1 and cfg.batch_size % cfg.dp:
        raise ValueError(f"--batch-size {cfg.batch_size} does not split evenly over --dp "
                         f"{cfg.dp} replicas")
    if cfg.balance != "even" and cfg.model not in BALANCED_MODELS:
        raise ValueError(f"--balance {cfg.balance} applies to --model "
                         f"{' and '.join(BALANCED_MODELS)}, not to {cfg.model} (its experts or "
                         "tables are not balanced yet)")
    if cfg.balance != "even" and cfg.dp > 1 and cfg.overlap and not cfg.sequence_parallel:
        raise ValueError(f"--balance {cfg.balance} with --dp {cfg.dp} needs --no-overlap: after "
                         "a migration data parallelism is rebuilt by DDP (FSDP2's re-sharding "
                         "is not built), and DDP does not see the weight gradients fused "
                         "row-parallel layers add outside autograd")


def placement_line(layout: MeshLayout, hosts: int) -> str:
    """Which ranks form the tp and dp groups, which share a host, which axis crosses hosts."""
    if not hosts:
        return f"{layout.describe()}; one machine (loopback)"
    per_host = layout.world_size // hosts
    blocks = [list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]
    return f"{layout.describe(hosts=hosts)}; hosts {blocks}"


class _TeeTimer:
    """A layer's compute timer feeding two: the balancer's (None without one) and the
    tally's; it adds the work it is told of to the tally's step."""

    def __init__(self, first, second, tally: "StepTally"):
        self.first, self.second, self.tally = first, second, tally

    def begin(self, device):
        return (None if self.first is None else self.first.begin(device),
                self.second.begin(device))

    def count(self, work: float) -> None:
        if self.first is not None:
            self.first.count(work)
        self.second.count(work)
        self.tally.work += work

    def end(self, token, work: float = 0.0) -> None:
        self.second.end(token[1], work)
        if self.first is not None:
            self.first.end(token[0], work)
        self.tally.work += work


class StepTally:
    """This rank's timed compute per step: seconds (the straggler's sleeps included), work
    (weight elements multiplied) and its slowdown factor. A ``SpeedMonitor`` that never
    exchanges (no collective), whose timers sit beside those already on ``model``'s layers."""

    def __init__(self, model: torch.nn.Module):
        from .balance import SpeedMonitor

        self.monitor = SpeedMonitor(None)
        self.work, self._seen = 0.0, 0.0
        self.rows: list[tuple[int, float, float, float]] = []  # (step, s, work, factor)
        for name, layer in model.named_modules():
            if hasattr(layer, "compute_timer"):
                layer.compute_timer = _TeeTimer(layer.compute_timer, self.monitor.timer(name),
                                                self)

    def close_step(self, step: int) -> None:
        """After the step: its figures (on CUDA the monitor reads its events: a synchronize)."""
        from .runtime import rank_context

        self.monitor.discard()  # resolves pending CUDA timings into compute_s
        seconds, self._seen = self.monitor.compute_s - self._seen, self.monitor.compute_s
        factor = rank_context().straggler.factor(step) if dist.is_initialized() else 1.0
        self.rows.append((step, seconds, self.work, factor))
        self.work = 0.0

    def into_records(self, records: list[dict]) -> None:
        """Every rank's figures into the records of the steps tallied (a collective: every
        rank): ``compute_s``, ``work``, ``slow`` (lists over ranks), ``time_max_s``."""
        from .runtime.timing import agreed_max

        if not self.rows:
            return
        by_step = {r["step"]: r for r in records}
        local = torch.tensor([row[1:] for row in self.rows], dtype=torch.float64)  # [n, 3]
        parts, device = [local], torch.device("cpu")
        if dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            parts = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, local.to(device))
        table = torch.stack(parts).cpu()  # [ranks, n, 3]
        times = agreed_max([by_step[row[0]]["time_s"] for row in self.rows], device=device)
        for i, row in enumerate(self.rows):
            record = by_step[row[0]]
            record["compute_s"] = table[:, i, 0].tolist()
            record["work"] = table[:, i, 1].tolist()
            record["slow"] = table[:, i, 2].tolist()
            record["time_max_s"] = times[i]


class RankParallel:
    """One rank's share of ``--dp``/``--tp`` and ``--balance``; every rank makes one, in the
    same order of calls (each of ``wrap``, ``after_step`` and ``report`` may hold collectives)."""

    def __init__(self, cfg, ranks: int | None = None):
        self.cfg = cfg
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.layout = mesh_layout(cfg, ranks or world)
        self.mesh = self.layout.mesh() if self.layout.dp > 1 else None
        self.tp_group = self.mesh.get_group("tp") if self.mesh is not None else None
        self.dp_group = self.mesh.get_group("dp") if self.mesh is not None else None
        self.replica = self.mesh.get_local_rank("dp") if self.mesh is not None else 0
        self.balancer = self.tally = None
        self.tp_model = self.model = None
        self.dp_kind = ""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The tensor-parallel ``model`` made data-parallel over dp (unchanged at dp 1)."""
        self.tp_model = self.model = model
        if self.mesh is None:
            return model
        from .parallel.data import data_parallel

        # a balanced run re-applies data parallelism after a migration: DDP only (see above)
        kind = "auto" if self.cfg.balance == "even" else "ddp"
        self.model = data_parallel(model, self.mesh, kind=kind)
        self.dp_kind = "DDP" if self.model is not model else "FSDP2"  # fully_shard: in place
        return self.model

    def replica_rows(self, batches: Iterator) -> Iterator:
        """This replica's rows of every global batch (tensors whose first dim is the batch)."""
        dp = self.layout.dp
        for batch in batches:
            if dp == 1:
                yield batch
                continue
            rows = batch[0].shape[0] // dp
            share = slice(self.replica * rows, (self.replica + 1) * rows)
            yield tuple(t[share] for t in batch)

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Start the balancer (``--balance`` other than even) on the tensor-parallel model
        (``model``, or the one ``wrap`` made data-parallel), over its tp group, its speeds
        agreed over its dp group; then the step tally (every policy, even included)."""
        tp_model = self.tp_model if self.tp_model is not None else model
        if self.cfg.balance != "even":
            from .balance import Balancer, PolicyConfig

            policy = PolicyConfig(name=self.cfg.balance, confirm_steps=CONFIRM_STEPS,
                                  spike_steps=SPIKE_STEPS)
            self.balancer = Balancer(tp_model, optimizer, self.tp_group, policy, every=EVERY,
                                     refresh=REFRESH, dp_group=self.dp_group)
        self.tally = StepTally(tp_model)

    def after_step(self, record: dict) -> None:
        """After the optimizer step: the balancer's step (timed into ``time_s``, its
        decisions into ``record["decisions"]``), then the global batch's loss over dp."""
        if self.balancer is not None:
            start = time.perf_counter()
            done = self.balancer.step(record["step"])
            if self.mesh is not None and any(d.kind == "migrate" for d in done):
                from .parallel.data import replanned

                replanned(self.model, self.mesh)  # DDP's reducer for the new shapes
            record["time_s"] += time.perf_counter() - start
            if done:
                record["decisions"] = [d.to_json() for d in done]
        if self.tally is not None:
            self.tally.close_step(record["step"])
        if self.dp_group is not None:
            loss = torch.tensor([record["loss"]], dtype=torch.float64, device=self._device())
            dist.all_reduce(loss, group=self.dp_group)
            record["loss"] = float(loss) / self.layout.dp

    def _device(self):
        if dist.get_backend(self.dp_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def report(self, result: dict, steps: int) -> dict:
        """``result`` with the placement, what each parallel layer did, the balancer's
        decisions, final plans and measured compute, every rank's figures in the step
        records and the capacity ideal (collectives: every rank)."""
        from .train_report import capacity_ideal

        if self.tally is not None:
            self.tally.into_records(result["records"])
        result["ideal"] = capacity_ideal(result["records"], self.layout.dp_groups())
        hosts = self.cfg.extra.get("hosts", 0)
        result["placement"] = placement_line(self.layout, hosts)
        result["parallel"] = getattr(self.tp_model, "_plait_parallel", "")
        result["notes"] = list(getattr(self.tp_model, "_plait_notes", ()))
        if self.mesh is not None:
            result["parallel"] += f"; {self.dp_kind} over {self.layout.dp} replicas"
        if self.balancer is not None:
            monitor = self.balancer.monitor
            result["balance"] = {"policy": self.cfg.balance, "replicas": self.layout.dp,
                                 "decisions": [d.to_json() for d in self.balancer.log],
                                 "final_state": self.balancer.state(),
                                 "compute_s_per_step": monitor.compute_s / max(steps, 1),
                                 "monitor_s": monitor.overhead_s}
        return result
