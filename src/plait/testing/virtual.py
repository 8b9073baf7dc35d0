"""A virtual device: a rank whose clock moves only by the work it does, so every reading the
balancer takes, and every decision it makes, is known in advance whatever the machine's load.

    from plait.testing.virtual import VirtualDevice

    device = VirtualDevice().install()        # in the rank's own process
    with device:                              # the steps' compute is counted
        trainer.run(batches, steps)           # plait.training.loop.Trainer, with Balancing

The device takes ``seconds_per_flop`` per FLOP of its matrix products (``mm``, ``addmm``,
``bmm``, ``baddbmm``: what a tensor-parallel layer's time is made of) and nothing for
anything else. :meth:`install` puts its clock where this rank's decisions read time: the
speed monitor's compute clock and thread CPU clock (so the unmovable time, products run
outside the timed layers, is read too), the straggler emulation's clock (a rank ``F`` ×
slow waits ``(F − 1)`` × its FLOP time, counted by the monitor as compute, as a slower
device's would be, and not slept: the run loses no wall time to it) and the migration's
timer (moving weights does no product: a migration costs 0 steps). It is a model of the
monitor's input, not of the machine: tests of the balancer, the policy and the monitor feed
decisions these readings and assert the outcome exactly; their timing on real hardware is
``plait bench hetero``'s to measure.

Process-wide: ``install`` changes module attributes of this process (a rank's own process
under ``plait.runtime.launch``); ``uninstall`` puts them back.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["VirtualDevice", "PRODUCTS"]

PRODUCTS = frozenset({torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                      torch.ops.aten.baddbmm})


def _tensors(value):
    """The tensors in ``value``: a tensor, or lists of them nested (a gather's outputs)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class VirtualDevice(TorchDispatchMode):
    """This rank as a device taking ``seconds_per_flop`` per FLOP of its matrix products;
    see the module doc. ``now`` is its clock, ``sent`` the bytes this rank gave each
    collective, in order (a receive and a barrier give none and are not listed)."""

    def __init__(self, seconds_per_flop: float = 1e-9):
        super().__init__()
        if not seconds_per_flop > 0:
            raise ValueError(f"seconds_per_flop must be above 0, got {seconds_per_flop}")
        self.seconds_per_flop = seconds_per_flop
        self.now = 0.0
        self.sent: list[int] = []
        self.stall_s = 0.0
        self._saved: list[tuple[object, str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in PRODUCTS:
            a, b = args[-2], args[-1]
            self.now += 2 * a.numel() * b.shape[-1] * self.seconds_per_flop + self.stall_s
            self.stall_s = 0.0
        elif func.namespace == "c10d" and not any(k in func.name() for k in ("barrier", "recv")):
            # (outputs, inputs, ...) for the gathers, scatters and all-to-alls, else (tensors, ...)
            second = any(k in func.name() for k in ("gather", "scatter", "alltoall"))
            self.sent.append(sum(t.numel() * t.element_size()
                                 for t in _tensors(args[1] if second else args[0])))
        return out

    def read(self) -> float:
        """The device's clock, in seconds."""
        return self.now

    def clock(self, device=None):
        """``compute_clock``'s signature: this device's clock for any device."""
        return self.read

    def stall(self, seconds: float) -> None:
        """The next matrix product takes ``seconds`` longer (a preemption, a page fault)."""
        self.stall_s = seconds

    def install(self, *, unmovable: bool = True) -> "VirtualDevice":
        """Put this device's clock where the rank's decisions read time (see the module doc);
        returns the device, to be entered around the compute it counts. ``unmovable=False``:
        the monitor reads no unmovable time (plans by speed alone), as on CUDA."""
        import importlib

        from ..runtime.slow import straggler
        from ..balance import speed

        migrate = importlib.import_module("plait.balance.migrate")  # the package exports a function

        clocks = SimpleNamespace(thread_time=self.read, perf_counter=time.perf_counter,
                                 sleep=lambda seconds: None)
        self._patch(speed, "compute_clock", self.clock)
        self._patch(straggler, "compute_clock", self.clock)
        self._patch(speed, "time", clocks)
        if unmovable:
            self._patch(speed, "_REAL_CLOCKS", (*speed._REAL_CLOCKS, self.read))
        self._patch(straggler, "time", clocks)
        self._patch(migrate, "time", SimpleNamespace(perf_counter=self.read))
        return self

    def uninstall(self) -> None:
        """Put back what :meth:`install` replaced."""
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)

    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)
