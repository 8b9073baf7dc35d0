"""One architecture through ``plait.parallelize(model, "auto")`` against the model on one process.

``check(model_type, dtype)`` runs on every rank of a launch (``plait.runtime.launch`` or
``run_ranks``): each rank builds the tiny model (:mod:`plait.testing.tiny_hf`, one seed)
as the reference and a deep copy it makes parallel, then

- 3 SGD steps on both, on fixed batches: each step's loss and every parameter's gradient
  (the parallel model's gathered by name with ``full_state_dict(grads=True)``), and the
  first forward's logits, against the reference's;
- greedy ``generate()`` from a 5-token prompt after the steps: the same tokens;

or, where ``parallelize`` refuses, the refusal: its message (one line) and whether the
model's weights, buffers and modules are what they were (a refusal before any weight
changes). What is compared is a relative error per tensor (``max|a - b| / max|b|``):
exact is within the tolerance of the precision the model computes in (float64 1e-9:
reduction order alone; float64 with float32 inside 1e-5: a norm that upcasts to float32
rounds a 1e-16 difference of its input to one float32 ulp now and then, measured up to
2e-6 after 3 steps; float32 2e-4), or within 10x the model's own noise where that is
larger: the same 3 steps from weights moved by one rounding of its precision (gemma4's
gradients, float32 inside, grow 30x a step under SGD whatever moves them). A wrong cut,
a lost scale or a gradient that is a rank's share shows at 1e-3 and more.

Outcomes: ``exact``, ``refused``, ``DIFFERENT`` (numbers differ, silently: the one outcome
plait must never give), ``ERROR`` (parallelize accepted the model and a later call raised:
not silent, but not a one-line refusal either).
"""

from __future__ import annotations

import copy
import time

import torch

__all__ = ["check", "reference_dtype", "TOL", "STEPS"]

TOL = {"float64": 1e-9, "float64+float32": 1e-5, "float32": 2e-4}
STEPS = 3
LR = 0.1
PROMPT, NEW_TOKENS = 5, 4


def _batch(vocab: int, seed: int, rows: int = 2, seq: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (rows, seq), generator=g)  # clear of pad/bos/eos ids


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max|a - b| / max(max|b|, floor) (inf where the shapes differ; 0 for two empty
    tensors). ``floor``: a gradient that is rounding noise (1e-18 where it is 0 in exact
    arithmetic) is measured against the model's largest gradient, not against itself."""
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    scale = max(float(b.abs().max()), floor)
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def _snapshot(model: torch.nn.Module) -> tuple:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kinds = [(n, type(m).__name__) for n, m in model.named_modules()]
    return state, kinds


def _unchanged(model: torch.nn.Module, before: tuple) -> bool:
    state, kinds = before
    now = model.state_dict()
    return (set(now) == set(state) and all(torch.equal(now[k], v) for k, v in state.items())
            and [(n, type(m).__name__) for n, m in model.named_modules()] == kinds)


def _vocab(model) -> int:
    return int(model.get_input_embeddings().num_embeddings)


def _quiet() -> None:
    """transformers' warnings about tiny configs (a RoPE factor, a kernel's fallback) off."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def reference_dtype(model_type: str):
    """The dtype the tiny model runs in on one process (float64, else float32) and the
    reason it does not run at all (None where it does)."""
    from .tiny_hf import NotBuilt, tiny_model

    _quiet()
    why = None
    for dtype in (torch.float64, torch.float32):
        try:
            model = tiny_model(model_type, dtype)
            _steps_and_generate(model)
            return dtype, None
        except NotBuilt as err:
            return None, str(err)
        except Exception as err:  # noqa: BLE001 - whatever stops the plain model
            why = f"{type(err).__name__}: {_first_line(err)}"
    return None, f"the model does not run on one process: {why}"


def _steps_and_generate(model, record=None, steps: int = STEPS) -> list:
    """``steps`` SGD steps through the training loop (:class:`plait.training.loop.Trainer`),
    then greedy tokens; ``record(step, model, loss, logits)`` after each backward."""
    from ..training.loop import Component, Trainer

    vocab = _vocab(model)
    last: dict = {}

    def loss_fn(m, ids):
        out = m(input_ids=ids, labels=ids)
        last["out"] = out
        return out.loss

    class Seeded(Component):
        # a model that draws in training (PhiMoE's sparsemixer samples its routing) draws
        # the same numbers in the reference and in the copy
        def before_step(self, step):
            torch.manual_seed(1000 + step)

    class Recorded(Component):
        def after_backward(self, step):
            if record is not None:
                record(step, model, last["out"].loss, last["out"].logits)

    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn,
                      components=[Seeded(), Recorded()])
    for step in range(steps):
        trainer.step(step, _batch(vocab, 100 + step))
    ids = _batch(vocab, 7, seq=PROMPT)
    torch.manual_seed(1000 + steps)
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
    return tokens.tolist()


def precision(model, dtype, ids: torch.Tensor | None = None) -> str:
    """The precision the model computes in: its dtype, or ``"float64+float32"`` where a
    float64 model's forward makes float32 (or complex64) tensors on the way (a norm's
    upcast, RoPE in complex64). ``ids``: the model is called ``model(ids)`` (else
    transformers' ``model(input_ids=...)`` on a batch of its vocabulary)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if dtype != torch.float64:
        return str(dtype).removeprefix("torch.")
    seen = set()

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                    seen.add(t.dtype)
            return out

    with torch.no_grad(), Dtypes():
        if ids is None:
            model(input_ids=_batch(_vocab(model), 100))
        else:
            model(ids)
    return "float64+float32" if seen - {torch.float64, torch.complex128} else "float64"


def check(model_type: str, dtype_name: str = "float64", *, steps: int = STEPS,
          noise: bool = True) -> dict:
    """Run on every rank: the parallel model against the reference (see the module doc).
    ``noise=False``: no run from perturbed weights, every step held to the precision's bar
    (a test of architectures known not to amplify rounding; half the time)."""
    import plait
    from .tiny_hf import tiny_model

    torch.set_num_threads(1)
    _quiet()
    dtype = getattr(torch, dtype_name)
    ref = tiny_model(model_type, dtype)
    computes = precision(ref, dtype)
    par, noisy = copy.deepcopy(ref), _perturbed(ref, NOISE[computes])
    before = _snapshot(par)
    start = time.perf_counter()
    try:
        plait.parallelize(par, "auto")
        parallelize_s = round(time.perf_counter() - start, 2)
    except (ValueError, TypeError) as err:
        return {"outcome": "refused", "why": str(err), "unchanged": _unchanged(par, before),
                "one_line": "\n" not in str(err).strip()}
    refs: list = []
    want_tokens = _steps_and_generate(ref, lambda step, m, loss, logits: refs.append(
        (loss.detach().clone(), logits.detach().clone() if step == 0 else None,
         {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
          for n, p in m.named_parameters()})), steps)
    noise_run = _Errors(refs, lambda m: {n: p.grad for n, p in m.named_parameters()})
    noise_tokens = _steps_and_generate(noisy, noise_run, steps) if noise else want_tokens
    errors = _Errors(refs, lambda m: plait.full_state_dict(m, grads=True))
    try:
        got_tokens = _steps_and_generate(par, errors, steps)
    except Exception as err:  # noqa: BLE001 - accepted, then failed: not a refusal
        return {"outcome": "ERROR", "why": f"{type(err).__name__}: {_first_line(err)}",
                "errors": errors.worst, "steps_compared": errors.steps}
    # each step's bar: the dtype's tolerance, or 10x how far the model itself moved at that
    # step from weights moved by one rounding of its precision (SGD on a tiny model
    # amplifies it step by step; the first step's bar stays the tolerance)
    moved = noise_run.per_step if noise else {k: [0.0] * len(v)
                                              for k, v in errors.per_step.items()}
    bars = {k: [max(TOL[computes], 10 * n) for n in moved[k]] for k in moved}
    over = [f"{k} {e:.1e} > {b:.0e} at step {i}" for k in bars
            for i, (e, b) in enumerate(zip(errors.per_step[k], bars[k])) if e > b]
    tokens_matter = noise_tokens == want_tokens
    exact = not over and (got_tokens == want_tokens or not tokens_matter)
    e = errors.worst
    why = "" if exact else (
        f"first logits {e['logits']:.1e}, losses {e['loss']:.1e}, gradients {e['grads']:.1e} "
        f"({errors.name}) relative ({'; '.join(over) or 'within the bars'}); generated tokens "
        f"{'equal' if got_tokens == want_tokens else 'differ'}")
    return {"outcome": "exact" if exact else "DIFFERENT", "errors": e, "why": why,
            "precision": computes, "tolerance": TOL[computes], "per_step": errors.per_step,
            "noise": moved, "worst_grad": errors.name,
            "tokens_equal": got_tokens == want_tokens,
            "applied": plait.parallel.applied(par)[:1], "parallelize_s": parallelize_s}


NOISE = {"float64": 2.0 ** -52, "float64+float32": 2.0 ** -24, "float32": 2.0 ** -24}


def _perturbed(model, eps: float):
    """A copy of ``model`` with every weight moved by up to ``eps`` of itself (fixed seed):
    how far the model's own numbers move at its precision's rounding."""
    noisy = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in noisy.parameters():
            if p.is_floating_point():
                u = torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1
                p.mul_((1 + eps * u).to(p.dtype))
    return noisy


class _Errors:
    """The record callback of ``_steps_and_generate``: each step's loss, the first logits and
    every gradient (``grads(model)`` by name) against the reference's ``refs``."""

    def __init__(self, refs: list, grads):
        self.refs, self.grads = refs, grads
        self.per_step: dict[str, list[float]] = {"loss": [], "logits": [], "grads": []}
        self.name, self.steps, self._worst_grad = "", 0, 0.0

    @property
    def worst(self) -> dict[str, float]:
        return {k: max(v, default=0.0) for k, v in self.per_step.items()}

    def __call__(self, step, model, loss, logits):
        want_loss, want_logits, want_grads = self.refs[step]
        self.per_step["loss"].append(_rel(loss, want_loss))
        if want_logits is not None:
            self.per_step["logits"].append(_rel(logits, want_logits))
        grads = self.grads(model)
        floor = 1e-8 * max(float(g.abs().max()) for g in want_grads.values() if g.numel())
        step_worst = 0.0
        for name, want in want_grads.items():
            got = grads.get(name)
            got = torch.zeros_like(want) if got is None and name in grads else got
            e = float("inf") if got is None else _rel(got, want, floor)
            step_worst = max(step_worst, e)
            if e > self._worst_grad:
                self._worst_grad, self.name = e, name
        self.per_step["grads"].append(step_worst)
        self.steps += 1


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__
