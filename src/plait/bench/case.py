"""One operator at one shape on this rank, as ``plait bench ops`` times and checks it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.timing import agreed_max

__all__ = ["Case", "SLOTS", "check_outputs"]

SLOTS = 2  # buffer sets: "beside" works on one while the other's first stage runs


class Case:
    """One operator at one shape on this rank: ``compute(slot)``, ``comm(async_op, slot)``,
    ``result(slot)``, ``run(chunks)``.

    ``compute`` and ``comm`` are the operator's two halves written with plain torch and
    torch.distributed calls (none of plait.ops), each on its own buffers of ``slot``: run
    one after the other (``comm_first`` says which first) they are the plain path, and
    ``result(slot)`` is then what the operator must return (:meth:`reference`). Slot 0
    serves the halves timed alone and the reference; :meth:`beside` alternates slots.
    """

    op = ""
    seed = 1234  # per case class: each draws its own inputs
    comm_first = False  # the plain path's order: compute, then the collective (a gather: reverse)

    def __init__(self, shape: dict, dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.gen = torch.Generator().manual_seed(self.seed + self.rank)
        self._ready, self._done = 0, None  # beside's slots: first stage done; last finished

    def randn(self, *size):
        return torch.randn(*size, generator=self.gen, dtype=self.dtype)

    def tolerance(self) -> float:
        return 1e-4

    def reference(self) -> torch.Tensor:
        """The plain path from the case's own halves, one after the other, in slot 0: what
        every timed variant must return (independent of plait.ops's code)."""
        self._first_stage(0)
        if self.comm_first:
            self.compute(slot=0)
        else:
            self.comm(slot=0)
        return self.result(0).clone()

    def start_beside(self) -> None:
        """The first stage of beside's next slot alone (untimed): the one it takes on."""
        self._first_stage(self._ready)

    def beside(self):
        """The compute and the plain path's transfer at once, neither waiting for the other
        (no data dependency): the best any schedule of this operator can do on this machine,
        where the transfer's own CPU work shares the cores with the compute.

        Each call finishes the plain path of the slot whose first stage ran in the call
        before (or in :meth:`start_beside`) while it runs the other slot's first stage: a
        gather's next buffer travels under the GEMM of the last one, the last product
        travels under the next one's compute. :meth:`beside_result` is the finished slot's
        result, the plain path's, one call late."""
        ready, fresh = self._ready, 1 - self._ready
        if self.comm_first:
            work = self.comm(async_op=True, slot=fresh)
            self.compute(slot=ready)
        else:
            work = self.comm(async_op=True, slot=ready)
            self.compute(slot=fresh)
        work.wait()
        self._ready, self._done = fresh, ready

    def beside_result(self) -> torch.Tensor:
        assert self._done is not None, "beside() has not run"
        return self.result(self._done)

    def _first_stage(self, slot: int) -> None:
        if self.comm_first:
            self.comm(slot=slot)
        else:
            self.compute(slot=slot)

    def plain(self):
        """Compute, then the collective (or the collective, then compute): the operator's
        own plain path (one piece)."""
        return self.run(1)


def check_outputs(case: Case, outputs: dict[str, list[torch.Tensor]]
                  ) -> dict[str, tuple[float, bool]]:
    """Each variant's outputs against ``case.reference()``: name → (the largest
    |difference| over its outputs and every rank, ``inf`` for a wrong shape or dtype or a
    NaN; whether every rank's is within the case's tolerance, relative to its largest
    |reference|). The same on every rank."""
    reference = case.reference()
    # a variant that gave no output was not checked: not correct either
    diffs = [max((_max_diff(out, reference) for out in outs), default=float("inf"))
             for outs in outputs.values()]
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    limit = case.tolerance() * max(scale, 1.0)
    flags = [0.0 if d <= limit else 1.0 for d in diffs]  # each rank against its own scale
    agreed = agreed_max(diffs + flags, device=reference.device)
    n = len(diffs)
    return {name: (agreed[i], agreed[n + i] == 0.0) for i, name in enumerate(outputs)}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return float("inf") if diff != diff else diff  # NaN: as wrong as it gets, and it orders
