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
The queue is the operator's context's (``OpsContext.deferred``): one per group. Each
piece of work belongs to the backward pass that queued it: a pass that raised part-way never
ran its end callback, and its work is dropped, never added to a later step's gradients.
"""

from __future__ import annotations

from typing import Callable

import torch

from .context import OpsContext, contexts

__all__ = ["accumulate", "defer", "pending", "run_deferred"]


def defer(ctx: OpsContext, work: Callable[[], None]) -> None:
    """Run ``work`` later in this backward pass (under one of ``ctx``'s collectives, or at
    the pass's end).

    Each call queues its own end callback (a no-op once the work has run), so a
    backward that failed part-way cannot leave a later one without its callback."""
    ctx.deferred.append((torch._C._current_graph_task_id(), work))
    torch.autograd.Variable._execution_engine.queue_callback(lambda: run_deferred(ctx))


def _held(ctx: OpsContext | None) -> list[OpsContext]:
    return [ctx] if ctx is not None else contexts()


def run_deferred(ctx: OpsContext | None = None) -> None:
    """Run ``ctx``'s deferred work of this backward pass now (None: every group's), oldest
    first; work another pass queued (one that raised before its end) is dropped."""
    task = torch._C._current_graph_task_id()  # -1 outside a backward pass
    for held in _held(ctx):
        while held.deferred:
            queued, work = held.deferred.pop(0)
            if queued == task:
                work()


def pending(ctx: OpsContext | None = None) -> int:
    """How much work ``ctx`` holds back (None: every group's)."""
    return sum(len(held.deferred) for held in _held(ctx))


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param.grad`` as autograd's accumulation would."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
