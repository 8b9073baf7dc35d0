"""Weight gradients held back until a collective's wire time can hide them.

A row-parallel layer's backward (``matmul_all_reduce``'s) sends nothing: its
weight gradient, needed by nothing else in the backward, would run while the
link sits idle. Given ``wgrad_into=`` (the weight parameter), that operator
:func:`defer` s it instead; the next fused operator whose backward has pieces on
the wire (``column_parallel_matmul``'s dgrad all-reduce) runs what is pending
there (:func:`run_deferred`), and whatever is still pending when the backward
ends runs then (a callback queued on the autograd engine, as DDP queues its
own). The gradient is added to the parameter's ``.grad`` directly, so it
counts for ``loss.backward()`` and the optimizer, not for
``torch.autograd.grad``, which never sees it: layers defer only where asked.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["accumulate", "defer", "pending", "run_deferred"]

_pending: list[Callable[[], None]] = []


def defer(work: Callable[[], None]) -> None:
    """Run ``work`` later in this backward pass (under a collective, or at its end).

    Each call queues its own end callback (a no-op once the work has run), so a
    backward that failed part-way cannot leave a later one without its callback."""
    _pending.append(work)
    torch.autograd.Variable._execution_engine.queue_callback(run_deferred)


def run_deferred() -> None:
    """Run every deferred piece of work now, oldest first."""
    while _pending:
        _pending.pop(0)()


def pending() -> int:
    return len(_pending)


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param.grad`` as autograd's accumulation would."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
