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

Balancing: ``plait.balance.Balancer`` steps after every optimizer step, inside the step's
time (the loop's :class:`~plait.training.components.Balancing`, as in ``bench hetero``);
its decisions go into the step's record and the run's result. With ``dp > 1`` data parallelism needs every replica in a tp position to
hold the same shapes, so the plans are agreed across dp: the balancer runs on each rank's tp
group with its dp group beside it, every speed reading is its tp position's slowest
replica's (``plait.balance.balancer.ReplicaMonitor``), and every replica takes the same
decisions. After a migration DDP's reducer is rebuilt for the new shapes
(``plait.parallel.data.replanned``, which checks the replicas first). A balanced run with
``dp > 1`` is data-parallel by DDP: FSDP2's sharding is not rebuilt after a migration. DDP
does not see the weight gradients fused row-parallel layers add outside autograd, so it
needs ``--no-overlap`` unless ``--sequence-parallel`` (refused in one line).

The capacity ideal (``plait.training.report.capacity_ideal``), with or without a balancer:
a :class:`~plait.training.tally.StepTally` times every plait layer's compute regions beside
the balancer's monitor and closes each step's figures after the step (outside its time);
``report`` gathers them from every rank into the step records and computes the ideal.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from ..nn.record import applied
from ..parallel.data import MeshLayout
from .components import Balancing
from .loop import Component
from .tally import StepTally

__all__ = ["mesh_layout", "placement_line", "RankParallel"]

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


def placement_line(layout: MeshLayout, hosts: int) -> str:
    """Which ranks form the tp and dp groups, which share a host, which axis crosses hosts."""
    if not hosts:
        return f"{layout.describe()}; one machine (loopback)"
    per_host = layout.world_size // hosts
    blocks = [list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]
    return f"{layout.describe(hosts=hosts)}; hosts {blocks}"


class RankParallel:
    """One rank's share of ``--dp``/``--tp`` and ``--balance``; every rank makes one, in the
    same order of calls (``wrap``, the components' steps and ``report`` may hold collectives)."""

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
        from ..parallel.data import data_parallel

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
            from ..balance import Balancer, PolicyConfig

            policy = PolicyConfig(name=self.cfg.balance, confirm_steps=CONFIRM_STEPS,
                                  spike_steps=SPIKE_STEPS)
            self.balancer = Balancer(tp_model, optimizer, self.tp_group, policy, every=EVERY,
                                     refresh=REFRESH, dp_group=self.dp_group)
        self.tally = StepTally(tp_model)

    def components(self) -> list[Component]:
        """What the loop runs around each step for this rank's share (after ``attach``): the
        balancer's step (DDP's reducer rebuilt after a migration), the step tally, then the
        global batch's loss over dp."""
        out: list[Component] = []
        if self.balancer is not None:
            replan = None if self.mesh is None else self._replanned
            out.append(Balancing(self.balancer, after_migrate=replan))
        if self.tally is not None:
            out.append(self.tally)
        if self.dp_group is not None:
            out.append(_ReplicaLoss(self))
        return out

    def _replanned(self) -> None:
        from ..parallel.data import replanned

        replanned(self.model, self.mesh)  # DDP's reducer for the new shapes

    def report(self, result: dict, steps: int) -> dict:
        """``result`` with the placement, what each parallel layer did, the balancer's
        decisions, final plans and measured compute, every rank's figures in the step
        records and the capacity ideal (collectives: every rank)."""
        from .report import capacity_ideal

        if self.tally is not None:
            self.tally.into_records(result["records"])
        result["ideal"] = capacity_ideal(result["records"], self.layout.dp_groups())
        hosts = self.cfg.extra.get("hosts", 0)
        result["placement"] = placement_line(self.layout, hosts)
        done = applied(self.tp_model)
        result["parallel"] = done[0] if done else ""
        result["notes"] = list(done[1:])
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


class _ReplicaLoss(Component):
    """The global batch's loss: every replica's own rows' loss, averaged over dp (the rows are
    equal in number and length)."""

    def __init__(self, run: RankParallel):
        self.group, self.dp = run.dp_group, run.layout.dp
        nccl = dist.get_backend(self.group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else \
            torch.device("cpu")

    def after_step(self, record: dict) -> None:
        loss = torch.tensor([record["loss"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss, group=self.group)
        record["loss"] = float(loss) / self.dp
