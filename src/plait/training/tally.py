"""The step tally: this rank's timed compute per step, for the capacity ideal of every run
(``plait.training.report.capacity_ideal``), balanced or not."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .loop import Component

__all__ = ["StepTally"]


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


class StepTally(Component):
    """This rank's timed compute per step: seconds (the straggler's sleeps included), work
    (weight elements multiplied) and its slowdown factor. A ``SpeedMonitor`` that never
    exchanges (no collective), whose timers sit beside those already on ``model``'s layers;
    each step's figures are closed after the step (outside its time)."""

    def __init__(self, model: torch.nn.Module):
        from ..balance import SpeedMonitor

        self.monitor = SpeedMonitor(None)
        self.work, self._seen = 0.0, 0.0
        self.rows: list[tuple[int, float, float, float]] = []  # (step, s, work, factor)
        for name, layer in model.named_modules():
            if hasattr(layer, "compute_timer"):
                layer.compute_timer = _TeeTimer(layer.compute_timer, self.monitor.timer(name),
                                                self)

    def after_step(self, record: dict) -> None:
        self.close_step(record["step"])

    def close_step(self, step: int) -> None:
        """After the step: its figures (on CUDA the monitor reads its events: a synchronize)."""
        from ..runtime import rank_context

        self.monitor.discard()  # resolves pending CUDA timings into compute_s
        seconds, self._seen = self.monitor.compute_s - self._seen, self.monitor.compute_s
        factor = rank_context().straggler.factor(step) if dist.is_initialized() else 1.0
        self.rows.append((step, seconds, self.work, factor))
        self.work = 0.0

    def into_records(self, records: list[dict]) -> None:
        """Every rank's figures into the records of the steps tallied (a collective: every
        rank): ``compute_s``, ``work``, ``slow`` (lists over ranks), ``time_max_s``."""
        from ..runtime.timing import agreed_max

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
