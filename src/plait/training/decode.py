"""Decoding with a KV cache, token by token, timed: what ``plait generate`` and ``plait bench
decode`` run.

    out = decode(model, prompt_ids, max_new_tokens=48)          # greedy
    out = decode(model, prompt_ids, 48, sample=True, seed=1, temperature=0.8, top_k=50)
    out.tokens, out.ttft_s, out.step_s                          # [B, S + new], s, [s …]

``model`` is a causal LM with transformers' interface (``model(input_ids=,
past_key_values=, use_cache=True)`` returning ``logits`` and ``past_key_values``): a
plain one, or one :func:`plait.parallelize` made tensor-parallel (then every rank of its
group calls ``decode`` with the same prompt: every forward is a collective). The first
forward reads the whole prompt (the prefill: time to first token); each next one reads
the one token just chosen, its keys and values cached. Greedy takes the most likely
token; sampling draws from ``softmax(logits / temperature)`` over the ``top_k`` most
likely, from a generator seeded with ``seed``, the same on every rank, so every rank
draws the same tokens from the same (replicated) logits.

Times are this rank's own wall clock around each forward and the choice of its token (a
CUDA device synchronised first): no collective is added to a step; the caller takes
each step's slowest rank once decoding is done.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

__all__ = ["decode", "Decoded", "step_figures"]


@dataclass
class Decoded:
    tokens: torch.Tensor        # [B, S + new]: the prompt, then the new tokens
    ttft_s: float               # the prefill, to the first new token
    step_s: list[float]         # every next token's step


def step_figures(step_s, batch: int) -> dict:
    """What a run of decoding steps (seconds each, a step the slowest rank's) reports:
    ``ms_per_token`` (the median step), ``p99_ms`` and ``tokens_per_s`` (``batch`` tokens a
    step)."""
    steps = sorted(step_s)
    median = statistics.median(steps)
    return {"ms_per_token": median * 1e3,
            "p99_ms": steps[min(len(steps) - 1, int(0.99 * len(steps)))] * 1e3,
            "tokens_per_s": batch / median}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _choose(logits: torch.Tensor, sample: bool, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row from its last logits [B, V] → [B]."""
    if not sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).view(-1).to(logits.device)


def _cache_name(model) -> str:
    """The keyword the model's forward takes its KV cache by: ``cache`` (transformers 5.2x),
    ``past_key_values`` before."""
    import inspect

    forward = getattr(model, "forward", model)
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def decode(model, prompt: torch.Tensor, max_new_tokens: int, *, sample: bool = False,
           temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
           eos_token_id: int | None = None,
           attention_mask: torch.Tensor | None = None, on_step=None) -> Decoded:
    """``max_new_tokens`` tokens after ``prompt`` ([B, S] ids), one forward a token; see the
    module doc. Stops early once every row has produced ``eos_token_id``.
    ``attention_mask`` ([B, S], 0 at padding): prompts of different lengths, padded on the
    left; each row's positions count its own tokens only. ``on_step()``: called after each
    token's forward (every rank; a speed monitor's exchange), outside the timed step."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if sample and not temperature > 0:
        raise ValueError(f"temperature must be above 0, got {temperature}")
    device = prompt.device
    generator = torch.Generator().manual_seed(seed) if sample else None
    tokens, steps = prompt, []
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    masked = {}
    if attention_mask is not None:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        masked = {"attention_mask": attention_mask, "position_ids": positions}
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=prompt, use_cache=True, **masked)
    nxt = _choose(out.logits[:, -1], sample, temperature, top_k, generator)
    _sync(device)
    ttft = time.perf_counter() - start
    name = _cache_name(model)
    cache = _cache_of(out)
    if on_step is not None:
        on_step()
    for _ in range(max_new_tokens - 1):
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if eos_token_id is not None:
            done |= nxt == eos_token_id
            if bool(done.all()):
                return Decoded(tokens, ttft, steps)
        if masked:
            masked = {"attention_mask": torch.cat([masked["attention_mask"],
                                                   masked["attention_mask"].new_ones(len(nxt), 1)], 1),
                      "position_ids": masked["position_ids"][:, -1:] + 1}
        start = time.perf_counter()
        out = model(input_ids=nxt[:, None], use_cache=True, **{name: cache}, **masked)
        nxt = _choose(out.logits[:, -1], sample, temperature, top_k, generator)
        cache = _cache_of(out)
        _sync(device)
        steps.append(time.perf_counter() - start)
        if on_step is not None:
            on_step()
    return Decoded(torch.cat([tokens, nxt[:, None]], dim=1), ttft, steps)
