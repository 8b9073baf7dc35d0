"""Where the axes of a ``dp × tp`` mesh run, and what that costs a training step.

Ranks sit on hosts in contiguous blocks (torchrun's and the emulated cluster's
order). Placement ``tp-inside-host`` puts a tp group on consecutive ranks
(``rank = d·tp + t``), so tensor parallelism stays on a host and data
parallelism crosses hosts; ``tp-across-hosts`` puts a tp group ``dp`` ranks
apart (``rank = t·dp + d``), the other way round. :func:`predict_placements`
prices one step of both, from numbers only (no torch.distributed):

- compute: ``StepWork.flops / Hardware.flops_per_s``, spread evenly over the
  layers, a third forward and two thirds backward;
- a collective on an axis is a ring all-reduce over the group's ranks in rank
  order: each rank sends ``2(n−1)/n`` of the buffer to its successor, so a
  group that spans hosts puts one ring edge's bytes on each host's link, and
  every group of that axis with a rank on the host shares the link. A call
  takes ``2(n−1)`` latency steps plus the slowest edge: the shared host link
  (``inter_Bps``) or a peer on the same host (``intra_Bps``);
- data parallelism as DDP all-reduces the gradients (``2(n−1)/n`` of them on
  the wire), as FSDP2 all-gathers the parameters before each block's forward
  and again before its backward and reduce-scatters its gradients
  (``3(n−1)/n``);
- overlap as :mod:`plait.perf.simulator` schedules it: a tp all-reduce is a
  fused pair with the compute before it (:func:`plait.perf.pipeline.fused_time`
  with ``tp_pieces`` pieces; one piece is compute, then the collective); the
  dp traffic runs on a network stream of its own, one block ahead
  (FSDP2's parameter gathers) or issued as each block's backward ends (the
  gradients), and the step ends when both streams have;
- not modelled: tp and dp traffic on the same link at once (in a 2 × 2 mesh on
  2 hosts one of the two axes stays on a host), the CPU a transfer takes from
  compute, and the optimizer, embeddings and norms beyond their FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .pipeline import PipelineOverheads, fused_time

__all__ = ["PLACEMENTS", "StepWork", "Hardware", "AxisCost", "PlacementPrediction",
           "placement_grid", "axis_groups", "allreduce_time", "predict_placement",
           "predict_placements", "transformer_flops"]

PLACEMENTS = {"tp-inside-host": True, "tp-across-hosts": False}
"""Placement name → whether a tp group is consecutive ranks (``MeshLayout.tp_inside_host``)."""
DP_KINDS = {"ddp": 2.0, "fsdp": 3.0}  # × (n−1)/n of the gradient (parameter) bytes on the wire


@dataclass(frozen=True, kw_only=True)
class StepWork:
    """One rank's work in one training step of a ``dp × tp`` model."""

    dp: int
    tp: int
    flops: float
    """FLOPs one rank computes per step, forward and backward"""
    layers: int
    """blocks (FSDP2 gathers and gradient reductions go block by block)"""
    tp_allreduces: int
    """all-reduces on the tp axis per step (4 a GPT block: 2 forward, 2 backward)"""
    tp_allreduce_bytes: float
    """bytes of each (a replica's ``[B/dp, S, D]`` activations)"""
    dp_bytes: float
    """a rank's gradient bytes (its tp share of the parameters), reduced over dp"""
    dp_kind: str = "ddp"
    """ddp (one all-reduce of the gradients) or fsdp (FSDP2: two gathers and a scatter)"""
    tp_pieces: int = 1
    """pieces each tp all-reduce is pipelined in with its compute (1: compute, then it)"""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "layers", "tp_pieces"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepWork.{name} must be ≥ 1, got {getattr(self, name)}")
        for name in ("flops", "tp_allreduces", "tp_allreduce_bytes", "dp_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepWork.{name} must be ≥ 0, got {getattr(self, name)}")
        if self.dp_kind not in DP_KINDS:
            raise ValueError(f"StepWork.dp_kind must be one of {', '.join(DP_KINDS)}, "
                             f"got {self.dp_kind!r}")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The machine a placement runs on."""

    hosts: int
    """hosts the ranks are spread over in contiguous blocks (0 or 1: one machine)"""
    flops_per_s: float
    """a rank's compute rate while every rank computes"""
    intra_Bps: float
    """bytes/s a rank sends to a peer on its own host"""
    inter_Bps: float | None = None
    """bytes/s of one host's link, each direction (shared by its ranks); None: no link"""
    latency_s: float = 0.0
    """per ring step of a collective that crosses hosts"""
    intra_latency_s: float = 0.0
    """per ring step of a collective inside a host"""
    per_piece_overhead_s: float = 0.0
    overlap_slowdown: float = 0.0

    def __post_init__(self) -> None:
        if self.hosts < 0:
            raise ValueError(f"Hardware.hosts must be ≥ 0, got {self.hosts}")
        for name in ("flops_per_s", "intra_Bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware.{name} must be > 0, got {getattr(self, name)}")
        if self.inter_Bps is not None and not self.inter_Bps > 0:
            raise ValueError(f"Hardware.inter_Bps must be > 0 or None, got {self.inter_Bps}")
        if self.hosts > 1 and self.inter_Bps is None:
            raise ValueError(f"{self.hosts} hosts need a link rate (Hardware.inter_Bps)")


@dataclass(frozen=True)
class AxisCost:
    """One axis's collectives under a placement."""

    crosses_hosts: bool
    sharing: int
    """groups of this axis whose ring leaves one host over its link (the most on any host)"""
    call_s: float
    """one collective of the axis (tp: one all-reduce; dp: a step's traffic)"""


@dataclass(frozen=True)
class PlacementPrediction:
    """One placement's step, its parts in seconds."""

    placement: str
    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    compute_s: float
    tp: AxisCost
    dp: AxisCost
    tp_part_s: float
    """compute with every tp all-reduce, as fused pairs"""
    dp_exposed_s: float
    """what the dp stream adds after the compute stream is done"""
    step_s: float

    @property
    def across_hosts(self) -> str:
        axes = [a for a, c in (("tp", self.tp), ("dp", self.dp)) if c.crosses_hosts]
        return ", ".join(axes) or "nothing"

    def to_dict(self) -> dict:
        return {"placement": self.placement, "tp_groups": self.tp_groups,
                "dp_groups": self.dp_groups, "across_hosts": self.across_hosts,
                "compute_s": self.compute_s, "tp_allreduce_s": self.tp.call_s,
                "tp_link_sharing": self.tp.sharing, "dp_comm_s": self.dp.call_s,
                "dp_link_sharing": self.dp.sharing, "tp_part_s": self.tp_part_s,
                "dp_exposed_s": self.dp_exposed_s, "step_s": self.step_s}


def placement_grid(dp: int, tp: int, tp_inside_host: bool) -> list[list[int]]:
    """``grid[d][t]``: the rank at dp index d, tp index t (``MeshLayout.grid``'s order)."""
    if tp_inside_host:
        return [[d * tp + t for t in range(tp)] for d in range(dp)]
    return [[t * dp + d for t in range(tp)] for d in range(dp)]


def axis_groups(dp: int, tp: int, tp_inside_host: bool) -> dict[str, list[list[int]]]:
    grid = placement_grid(dp, tp, tp_inside_host)
    return {"tp": grid, "dp": [[row[t] for row in grid] for t in range(tp)]}


def _sharing(groups: list[list[int]], per_host: int) -> int:
    """The most groups spanning hosts that have a rank on any one host (0: none spans)."""
    load: dict[int, int] = {}
    for group in groups:
        hosts = {r // per_host for r in group}
        if len(hosts) > 1:
            for h in hosts:
                load[h] = load.get(h, 0) + 1
    return max(load.values(), default=0)


def allreduce_time(nbytes: float, n: int, sharing: int, hw: Hardware) -> float:
    """One ring all-reduce of ``nbytes`` over ``n`` ranks whose ring crosses host links
    shared by ``sharing`` groups (0: inside a host)."""
    if n == 1 or nbytes == 0:
        return 0.0
    wire = 2.0 * (n - 1) / n * nbytes  # a rank to its ring successor
    steps = 2 * (n - 1)
    if sharing == 0:
        return steps * hw.intra_latency_s + wire / hw.intra_Bps
    assert hw.inter_Bps is not None
    edge = max(sharing * wire / hw.inter_Bps, wire / hw.intra_Bps)
    return steps * hw.latency_s + edge


def _axis(groups: list[list[int]], nbytes: float, hw: Hardware, world: int) -> AxisCost:
    per_host = world // hw.hosts if hw.hosts > 1 else world
    share = _sharing(groups, per_host)
    return AxisCost(share > 0, share, allreduce_time(nbytes, len(groups[0]), share, hw))


def _dp_stream(work: StepWork, fwd_s: float, bwd_s: float, dp_s: float) -> float:
    """End of a step whose blocks take ``fwd_s`` and ``bwd_s`` each, with ``dp_s`` of dp
    traffic on a stream of its own (simulator.py's rules): FSDP2 gathers each block's
    parameters one block ahead, before its forward and before its backward; each block's
    gradients go as its backward ends; the step ends when both streams have."""
    n, per = work.layers, dp_s / work.layers
    gather = per / 3 if work.dp_kind == "fsdp" else 0.0
    grads = per - 2 * gather
    t = net = 0.0
    ready = None
    if gather:
        net = ready = gather  # the first block's parameters, before anything can run
    for block in range(2 * n):
        if ready is not None:
            t = max(t, ready)
            if block < 2 * n - 1:
                net = max(net, t) + gather
                ready = net
        t += fwd_s if block < n else bwd_s
        if block >= n:
            net = max(net, t) + grads
    return max(t, net)


def predict_placement(work: StepWork, hw: Hardware, placement: str) -> PlacementPrediction:
    """One step of ``work`` on ``hw`` under ``placement`` (a key of :data:`PLACEMENTS`)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: choose from {', '.join(PLACEMENTS)}")
    world = work.dp * work.tp
    if hw.hosts > 1 and world % hw.hosts:
        raise ValueError(f"dp {work.dp} × tp {work.tp} = {world} ranks do not split over "
                         f"{hw.hosts} hosts")
    groups = axis_groups(work.dp, work.tp, PLACEMENTS[placement])
    tp = _axis(groups["tp"], work.tp_allreduce_bytes, hw, world)
    dp_bytes = DP_KINDS[work.dp_kind] / 2 * work.dp_bytes  # as an all-reduce's buffer
    dp = _axis(groups["dp"], dp_bytes, hw, world)
    compute = work.flops / hw.flops_per_s
    if work.tp > 1 and work.tp_allreduces:
        pair = compute / work.tp_allreduces
        overheads = PipelineOverheads(hw.per_piece_overhead_s, hw.overlap_slowdown)
        tp_part = work.tp_allreduces * fused_time(pair, tp.call_s, work.tp_pieces, overheads,
                                                  comm_latency_s=0.0)
    else:
        tp_part = compute
    fwd, bwd = tp_part / 3 / work.layers, 2 * tp_part / 3 / work.layers
    end = _dp_stream(work, fwd, bwd, dp.call_s) if work.dp > 1 else tp_part
    return PlacementPrediction(placement, groups["tp"], groups["dp"], compute, tp, dp,
                               tp_part, end - tp_part, end)


def predict_placements(work: StepWork, hw: Hardware) -> dict[str, PlacementPrediction]:
    """Both placements of :data:`PLACEMENTS`, by name."""
    return {name: predict_placement(work, hw, name) for name in PLACEMENTS}


def transformer_flops(*, tokens: int, layers: int, tp: int, sharded_weights: float,
                      seq_len: int, width: int, replicated_weights: float = 0.0) -> float:
    """One rank's forward + backward FLOPs: ``6·tokens·w`` for each weight matrix element
    ``w`` it holds (forward 2, backward 4: input and weight gradients), the
    ``sharded_weights`` of a block split over tp, plus causal attention's
    ``4·tokens·S·D/tp · ½`` a block forward (3× with backward)."""
    linear = 6.0 * tokens * (layers * sharded_weights / tp + replicated_weights)
    attention = 3 * layers * 4.0 * tokens * seq_len * width / tp * 0.5
    return linear + attention
