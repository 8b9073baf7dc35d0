"""The owner of the fused operators' state for one process group.

An :class:`OpsContext` holds the calibration that ``chunks="auto"`` reads
(:mod:`plait.ops.calibration`), the cross-rank checks every call makes
(:mod:`plait.ops.agree`), and the record of which path each operator took and
why (``explain``). One context per group,
made on first use and kept for the group's lifetime; pass ``ctx=`` to an
operator to use another (a test, a benchmark that wants its own profile).
A call's own context is here too: a rank's refusal that every rank's next check must
make (:func:`refused`, :func:`attempt`).

The checks run on a sibling group of the same ranks (made with the context),
not on the group itself: a process group runs its collectives in the order
they were issued, so a check issued while another call's pieces are still in
flight (``matmul_all_reduce_start``) would otherwise wait for all of them.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from ..perf.calibrate import MachineProfile, default_profile_path
from ..runtime.dist import _timeout_s
from ..runtime.priority import prioritize_group
from ..transport.asked import checks_from_env
from .agree import start_gather_checked
from .calibration import Calibration, from_profile, measure
from ..perf.pieces import Work, predict

__all__ = ["Decision", "OpsContext", "get_context", "explain", "transport_of",
           "carries_checks", "attempt", "refused", "refusal_pending"]

log = logging.getLogger("plait.ops")

MIN_PIECE_BYTES = 64 * 1024  # below this a piece is all latency on every link
MIN_GAIN = 0.05  # fuse only when the model predicts at least this much: "never slower by surprise"


# --- a rank's refusal, made by every rank's next check ----------------------------
_REFUSED: ContextVar = ContextVar("plait_refused", default=None)


@contextlib.contextmanager
def refused(problem: Exception | None) -> Iterator[None]:
    """Have the next operator's check refuse ``problem`` on every rank (None: nothing).

    For a caller (a layer) whose own check of this rank's arguments failed before the
    operator it calls: raised here, it would leave the other ranks waiting in that
    operator's check. Call an operator that checks across ranks inside the block.
    """
    token = _REFUSED.set(problem)
    try:
        yield
    finally:
        _REFUSED.reset(token)


def refusal_pending() -> bool:
    """Whether the next operator's check must refuse (inside :func:`refused`): a plan
    cached from an earlier call (:meth:`plait.ops.context.OpsContext.carried_plan`) must
    not stand in for that check."""
    return _REFUSED.get() is not None


def attempt(check):
    """``(check(), None)``, or ``(None, the ValueError/TypeError it raised)``; or
    ``(None, the problem)`` inside ``refused(problem)`` (then ``check`` is not called)."""
    given = _REFUSED.get()
    if given is not None:
        _REFUSED.set(None)  # one operator's check refuses it
        return None, given
    try:
        return check(), None
    except (TypeError, ValueError) as err:
        return None, err


@dataclass(frozen=True)
class Decision:
    """Which path an operator call took: ``fused`` with ``chunks`` pieces, or ``fallback``."""

    op: str
    path: str
    chunks: int
    reason: str

    def line(self) -> str:
        pieces = "1 piece" if self.chunks == 1 else f"{self.chunks} pieces"
        return f"{self.op}: {self.path} ({pieces}): {self.reason}"


@dataclass
class OpsContext:
    group: object = None
    calibrated: Calibration | None = None
    max_chunks: int = 8  # beyond this, per-piece costs win on every link measured here
    # "always": one small all_gather of shapes per call (≈ one latency, 0.4 ms on the
    # emulated 1 Gbit/s link); "never": trust the caller where an operator needs no
    # global facts (MoE with a fixed chunk count).
    validate: str = "always"
    # "carried": on shared memory each check rides in its data call's header; "gather": every
    # check a call of its own (a gloo all_gather on the check group), as before the
    # shared-memory transport (PLAIT_CHECKS=gather; bench decode's plait-gather-checks
    # measures what carrying them saves)
    checks: str = field(default_factory=lambda: checks_from_env())
    # the group the checks run on: the same ranks, its own queue (None: ``group`` itself)
    checks_group: object = None
    decisions: dict[str, Decision] = field(default_factory=dict)
    # how bytes move on this group (plait.transport: shared memory or torch.distributed),
    # chosen with the context by every rank; None: torch.distributed (a context made by hand)
    transport: object = None
    # (op, work, most pieces) → the auto decision: pure in them and the calibration, and
    # ≈ 0.4 ms of Python to recompute, on every call
    _auto_made: dict[tuple, Decision] = field(default_factory=dict)
    _logged: set[tuple] = field(default_factory=set)
    # (op, each tensor's shape, strides, dtype and device, and the call's own arguments) →
    # what its carried check needs (carried_plan): made once per signature, not on every
    # call of a decoding step
    _plans: dict[tuple, object] = field(default_factory=dict)
    _measured_here: bool = False  # the calibration was measured on this group
    # weight gradients held back until one of this group's collectives can hide them
    # (plait.ops.deferred), run under it or when the backward ends
    deferred: list = field(default_factory=list)

    def __post_init__(self) -> None:
        _MADE.append(weakref.ref(self))  # run_deferred() finds one made by hand too

    @contextlib.contextmanager
    def using(self, transport):
        """Run this group's collectives on ``transport`` inside the block (a benchmark
        timing two transports in turn in one run); the decisions follow it."""
        saved, self.transport = self.transport, transport
        self._auto_made, self._plans = {}, {}
        try:
            yield transport
        finally:
            self.transport, self._auto_made, self._plans = saved, {}, {}

    def mover(self):
        """This group's transport (``plait.transport``): shared memory inside a host, else
        torch.distributed."""
        if self.transport is None:
            from ..transport.base import Choice, DistTransport

            backend = dist.get_backend(self.group)
            self.transport = DistTransport(self.group, Choice(backend, "a context made by hand"))
        return self.transport

    # --- calibration -------------------------------------------------------
    def calibration(self) -> Calibration:
        """What ``chunks="auto"`` predicts with: the saved profile if one exists
        (PLAIT_PROFILE or ~/.cache/plait/profile.json, from ``plait simulate --calibrate``),
        else measured on this group once (:func:`plait.ops.calibration.measure`)."""
        if self.calibrated is None:
            # Rank 0's word, everywhere: a profile saved on one host only (or a different
            # one per host) would otherwise have one rank measure, a collective its peers
            # never join, or pick piece counts its peers do not.
            path = default_profile_path()
            box = [from_profile(MachineProfile.load(path)) if path.exists() else None]
            if dist.get_world_size(self.group) > 1:
                root = dist.get_global_rank(self.group, 0) if self.group is not None else 0
                dist.broadcast_object_list(box, src=root, group=self.group)
            self.calibrated = box[0] if box[0] is not None else measure(self.group)
            self._measured_here = box[0] is None
        return self.calibrated

    def _loopback_measured(self) -> bool:
        """Whether the calibration was measured on this group (no saved profile): a profile
        saved by ``plait simulate --calibrate`` (or a test's) prices the transfers as it
        found them, and is followed as it stands."""
        self.calibration()
        return self._measured_here

    # --- decisions ---------------------------------------------------------
    def decide(self, op: str, chunks, *, work: Work, rows: int) -> Decision:
        """Fused with N pieces, or fallback and why. Same inputs on every rank → same answer.

        ``work``: the busiest rank's compute and wire bytes, as :mod:`plait.perf.pieces`
        prices them; ``rows``: the most pieces allowed.
        """
        if chunks == "auto" and not self.mover().pieces_overlap:
            return self._record(self._on_own_core(op))  # first: a decoding step's every call
        world = dist.get_world_size(self.group)
        if world == 1:
            return self._record(Decision(op, "fallback", 1, "one rank: nothing to communicate"))
        most = max(1, rows)
        if chunks != "auto":
            if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
                raise ValueError(f"{op}: chunks must be 'auto' or a positive integer, got {chunks!r}")
            n = min(chunks, most)
            if n == 1:
                why = "chunks=1 asked for" if chunks == 1 else f"only {rows} rows to split"
                return self._record(Decision(op, "fallback", 1, why))
            return self._record(Decision(op, "fused", n, f"chunks={chunks} asked for"))
        if self.mover().one_host and self._loopback_measured():
            # gloo between ranks of one host: loopback TCP, whose copies the cores that
            # compute make; measured on 2 ranks of this machine, pieces lost up to 1.5x
            # (bench ops --transport gloo). A saved profile is taken at its word instead.
            return self._record(Decision(op, "fallback", 1, "auto: gloo between ranks of one "
                                         "host is loopback TCP, copied by the cores that "
                                         "compute; pieces would not overlap them"))
        key = (op, work, min(self.max_chunks, most))
        if key not in self._auto_made:
            self._auto_made[key] = self._auto(*key)
        return self._record(self._auto_made[key])

    def carried_plan(self, key: tuple, make):
        """``(make(), None)``, made once per ``key`` (an operator and every shape, stride,
        dtype and device its check reads) while checks ride in headers: a decoding step
        calls each layer's operator with one signature every token, and validating it
        again each time cost microseconds of Python per call. ``make`` validates this
        rank's arguments: where it raises, ``(None, the problem)`` (the caller refuses the
        call on every rank), never cached; inside :func:`refused` the
        cache is not read. What every rank must agree on is still compared on every call,
        in the data call's header."""
        plan = None if key is None or refusal_pending() else self._plans.get(key)
        if plan is not None:
            return plan, None
        plan, problem = attempt(make)
        if problem is None and key is not None:
            if len(self._plans) > 1024:  # a signature a prompt length, say: keep it bounded
                self._plans.clear()
            self._plans[key] = plan
        return plan, problem

    def _on_own_core(self, op: str) -> Decision:
        """``chunks="auto"`` where the rank's own core moves the bytes (shared memory): the
        plain path. A piece's transfer cannot run beside the next piece's compute, and
        pieces only add calls (made once per operator: a decoding step asks often)."""
        made = self._auto_made.get((op, "own core"))
        if made is None:
            made = self._auto_made[op, "own core"] = Decision(
                op, "fallback", 1, "auto: shared memory moves the bytes on the rank's own "
                "core; pieces would not overlap them")
        return made

    def _auto(self, op, work: Work, most) -> Decision:
        cal = self.calibration()
        if work.wire_bytes <= 0:
            return Decision(op, "fallback", 1, "auto: nothing to send")
        most = min(most, max(1, int(work.wire_bytes // MIN_PIECE_BYTES)))
        if most < 2:
            return Decision(op, "fallback", 1, f"auto: pieces would be under {MIN_PIECE_BYTES} B "
                                               f"({work.wire_bytes:.0f} B to send)")
        plain = predict(cal, work, 1)
        times = {p: predict(cal, work, p) for p in range(2, most + 1)}
        # the predicted best, nothing added: the model prices what a piece costs (its GEMM's
        # rate, its call's latency, the per-piece overhead). A 2 % tie going to fewer pieces
        # took 7 where 8 ran 3-6 % faster; replayed on sweeps of every count, its worst shape
        # was 6.1 % off the best against the argmin's 3.6 % (README, simulate --validate)
        best = min(times, key=lambda p: (times[p], p))
        gain = 1.0 - times[best] / plain
        if gain < MIN_GAIN:
            return Decision(op, "fallback", 1,
                            f"auto: predicted gain {gain:.0%} at {best} pieces is under "
                            f"{MIN_GAIN:.0%} (plain path {plain * 1e3:.1f} ms, comm "
                            f"{cal.comm_time(work.kind, work.wire_bytes) * 1e3:.1f} ms)")
        return Decision(op, "fused", best, f"auto: {best} pieces, predicted {gain:.0%} faster "
                                           f"({times[best] * 1e3:.1f} vs {plain * 1e3:.1f} ms)")

    def _record(self, decision: Decision) -> Decision:
        self.decisions[decision.op] = decision
        key = (decision.op, decision.path, decision.chunks)
        if key not in self._logged:
            self._logged.add(key)
            if dist.get_rank(self.group) == 0:
                log.info("%s", decision.line())
        return decision

    # --- cross-rank checks -------------------------------------------------
    def gather_meta(self, op: str, width: int, row, problem: Exception | None = None,
                    verify=None) -> list[tuple[int, ...]]:
        """Every rank's ``row`` of ``width`` integers (dtype code, dims, sizes) before any
        data moves, raising on every rank if any rank's local checks failed
        (``problem``, with ``row`` None there); see :mod:`plait.ops.agree`."""
        return self.start_meta(op, width, row, problem, verify)()

    def start_meta(self, op: str, width: int, row, problem: Exception | None = None,
                   verify=None):
        """``gather_meta``, started: calling the result waits and gives what it gives.
        ``verify(rows)``: the operator's own check of every rank's row, which shared memory
        asks for its error where a peer carries the same check in a data call (a header of
        another width) and refuses the call either way; elsewhere unused (the operator
        verifies the rows it gets)."""
        if carries_checks(self) and width <= self.transport.header_words:
            # the check rides in a slot header (sized for any operator's on this group)
            rows = self.transport.gather_meta(op, row, width, problem, verify)
            return lambda: rows
        group = self.group if self.checks_group is None else self.checks_group
        done = start_gather_checked(op, group, problem, row, width)
        return lambda: [tuple(r) for r in done()]


def signature(op: str, *tensors) -> tuple | None:
    """What an operator's check reads of its tensors (shape, strides, dtype, device): the
    key of :meth:`OpsContext.carried_plan`; None where one is not a tensor (never cached)."""
    key = [op]
    for t in tensors:  # a loop, not a generator: this runs on every call of a decoding step
        if not isinstance(t, torch.Tensor):
            return None
        key += (t.shape, t.stride(), t.dtype, t.device)
    return tuple(key)


def carries_checks(ctx: "OpsContext") -> bool:
    """Whether ``ctx``'s checks ride in their data calls' headers (a transport that carries
    them, and not ``checks="gather"``)."""
    return ctx.checks == "carried" and ctx.mover().carries_checks


_CONTEXTS: dict[object, OpsContext] = {}


def get_context(group=None) -> OpsContext:
    """The context of ``group`` (default group: None), made on first use: collective the
    first time (every rank of the group calls it, as every operator does)."""
    if group not in _CONTEXTS:
        from ..transport.select import choose

        checks = _sibling(group)
        transport = choose(group, timeout_s=_timeout(group).total_seconds())
        _CONTEXTS[group] = OpsContext(group=group, checks_group=checks, transport=transport)
        if dist.get_rank(group) == 0:  # a fallback the user can fix is said on the terminal
            fixable = transport.choice.reason.startswith("auto: ") and \
                "/dev/shm" in transport.choice.reason
            log.log(logging.WARNING if fixable else logging.INFO, "transport: %s (%s)",
                    transport.choice.name, transport.choice.reason)
        prioritize_group(group)  # a new group's gloo threads, ahead of compute for a core
        if checks is not None:
            prioritize_group(checks)
    return _CONTEXTS[group]


_MADE: list[weakref.ref] = []  # every context made in this process, weakly


def contexts() -> list[OpsContext]:
    """Every context alive in this process: each group's and any made by hand."""
    alive = [ref() for ref in _MADE]
    _MADE[:] = [ref for ref, ctx in zip(_MADE, alive) if ctx is not None]
    return [ctx for ctx in alive if ctx is not None]


def transport_of(group=None):
    """The transport ``group``'s collectives take (its context's; made on first use)."""
    return get_context(group).mover()


def _sibling(group):
    """A new group of ``group``'s ranks, backend and timeout (None for a group of one)."""
    if dist.get_world_size(group) == 1:
        return None
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return dist.new_group(ranks, timeout=_timeout(group), backend=dist.get_backend(group),
                          use_local_synchronization=True)


def _timeout(group) -> timedelta:
    """The group's collective timeout (plait's default where the backend does not say)."""
    backend = dist.get_backend(group)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    try:
        return (group or dist.group.WORLD)._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return timedelta(seconds=_timeout_s(None))


def explain(op: str | None = None, group=None) -> str:
    """Which path the last call of each operator took, and why (one line each)."""
    made = _CONTEXTS.get(group)  # never made here: making one is collective (a barrier)
    decisions = made.decisions if made is not None else {}
    if op is not None:
        return decisions[op].line() if op in decisions else f"{op}: not called yet"
    return "\n".join(d.line() for d in decisions.values()) or "no fused operator called yet"
