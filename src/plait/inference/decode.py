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

from ..transport.base import latency_bound

__all__ = ["decode", "Decoded", "step_figures", "bucket"]


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


def _eos_ids(eos_token_id) -> list[int]:
    if eos_token_id is None:
        return []
    return [int(e) for e in eos_token_id] if isinstance(eos_token_id, (list, tuple)) \
        else [int(eos_token_id)]


def bucket(batch: int) -> int:
    """The batch a compiled step runs: the next power of two (a batch of 3 runs as 4), so a
    batch size within a bucket reuses its graph instead of compiling again."""
    return 1 << (max(1, batch) - 1).bit_length()


class _Steps:
    """A model's forwards for one decode: the prefill, then one token a step, with its KV
    cache (transformers' dynamic cache; or, ``compiled``, a static cache of the whole
    length and the step compiled with ``fullgraph=True``: one graph, no Python between the
    operators, the same shapes every step, the rows padded to their :func:`bucket` with
    copies of the first and their logits dropped). ``mask``: [B, S] (0 at left padding)."""

    def __init__(self, model, prompt: torch.Tensor, total: int, mask, compiled: bool):
        self.model, self.name, self.compiled = model, _cache_name(model), compiled
        self.device, self.length = prompt.device, prompt.shape[1]
        self.cache, self.forward = None, model
        self.rows = len(prompt)
        self.pad = bucket(self.rows) - self.rows if compiled else 0
        if compiled and mask is not None:  # the whole length's mask from the start: one shape
            mask = torch.cat([mask, mask.new_ones(len(mask), total - mask.shape[1])], 1)
        mask = self._padded(mask)
        self.mask = mask
        self.positions = None if mask is None else (mask.long().cumsum(-1) - 1).clamp(min=0)
        if compiled:
            from transformers import StaticCache

            self.cache = StaticCache(config=model.config, max_cache_len=total)
            self.forward = _compiled(model)

    def _padded(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """``rows`` [B, ...] with the bucket's padding rows (copies of the first)."""
        if rows is None or not self.pad:
            return rows
        return torch.cat([rows, rows[:1].expand(self.pad, *rows.shape[1:])])

    def _kw(self, count: int) -> dict:
        """The keywords of a forward of the ``count`` tokens that end at ``self.length``."""
        kw = {"use_cache": True}
        if self.compiled:
            kw[self.name] = self.cache
            kw["cache_position"] = torch.arange(self.length - count, self.length,
                                                device=self.device)
        if self.mask is not None:
            kw["attention_mask"] = self.mask if self.compiled else self.mask[:, :self.length]
            kw["position_ids"] = self.positions[:, self.length - count:self.length]
        return kw

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """The prompt's forward (not compiled: one shape a prompt); its last logits [B, V]."""
        with latency_bound():
            out = self.model(input_ids=self._padded(prompt), **self._kw(prompt.shape[1]))
        if self.cache is None:
            self.cache = _cache_of(out)
        return out.logits[:self.rows, -1]

    def step(self, nxt: torch.Tensor) -> torch.Tensor:
        """The forward of each row's chosen token [B]; its logits [B, V]."""
        with latency_bound():  # small calls, waited for at once: gloo's are exchanges
            return self._step(nxt)

    def _step(self, nxt: torch.Tensor) -> torch.Tensor:
        self.length += 1
        if self.mask is not None and not self.compiled:  # the mask grows with the cache
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(nxt), 1)], 1)
            self.positions = torch.cat([self.positions, self.positions[:, -1:] + 1], 1)
        if self.compiled:
            ids = self._padded(nxt[:, None])
            return self.forward(input_ids=ids, **self._kw(1)).logits[:self.rows, -1]
        out = self.model(input_ids=nxt[:, None], **{self.name: self.cache}, **self._kw(1))
        self.cache = _cache_of(out)
        return out.logits[:, -1]


_COMPILED: dict[int, object] = {}


def _compiled(model):
    """``model`` compiled once (``fullgraph=True``): later decodes reuse its graphs."""
    if id(model) not in _COMPILED:
        _COMPILED[id(model)] = torch.compile(model, fullgraph=True)
    return _COMPILED[id(model)]


@torch.no_grad()
def decode(model, prompt: torch.Tensor, max_new_tokens: int, *, sample: bool = False,
           temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
           eos_token_id: int | list[int] | None | str = "model",
           pad_token_id: int | None | str = "model",
           attention_mask: torch.Tensor | None = None, on_step=None,
           compiled: bool = False, cache_len: int | None = None) -> Decoded:
    """``max_new_tokens`` tokens after ``prompt`` ([B, S] ids), one forward a token; see the
    module doc. As transformers' ``generate`` does: a row that has produced an
    ``eos_token_id`` (one id or several; ``"model"``, the default: the model's generation
    config's; None: none) is finished, and its later tokens are ``pad_token_id`` (``"model"``:
    the generation config's, else the first EOS id) while the other rows go on; decoding
    ends once every row has finished. ``attention_mask`` ([B, S], 0 at padding): prompts of
    different lengths, padded on the left; each row's positions count its own tokens
    only. ``on_step()``: called after each token's forward (every rank; a speed monitor's
    exchange), outside the timed step. ``compiled``: a static KV cache and the step
    compiled (:class:`_Steps`); the first decode of a model pays the compilation, and a
    decode whose batch or ``cache_len`` (the static cache's positions, default prompt +
    ``max_new_tokens``) differs from every earlier one's compiles again."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if sample and not temperature > 0:
        raise ValueError(f"temperature must be above 0, got {temperature}")
    device = prompt.device
    generator = torch.Generator().manual_seed(seed) if sample else None
    config = getattr(model, "generation_config", None)
    if eos_token_id == "model":
        eos_token_id = getattr(config, "eos_token_id", None)
    if pad_token_id == "model":
        pad_token_id = getattr(config, "pad_token_id", None)
    eos = _eos_ids(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
    stops = torch.tensor(eos, device=device)
    steps, chosen = [], []
    live = torch.ones(prompt.shape[0], dtype=torch.bool, device=device)
    total = prompt.shape[1] + max_new_tokens if cache_len is None else cache_len
    if total < prompt.shape[1] + max_new_tokens:
        raise ValueError(f"cache_len {total} holds fewer positions than the prompt's "
                         f"{prompt.shape[1]} and {max_new_tokens} new tokens")
    runner = _Steps(model, prompt, total, attention_mask, compiled)
    _sync(device)
    start = time.perf_counter()
    logits = runner.prefill(prompt)
    nxt = _choose(logits, sample, temperature, top_k, generator)
    _sync(device)
    ttft = time.perf_counter() - start
    if on_step is not None:
        on_step()
    for i in range(max_new_tokens):
        if eos:
            nxt = torch.where(live, nxt, torch.full_like(nxt, pad))  # finished rows: padding
            live &= ~torch.isin(nxt, stops)
        chosen.append(nxt)
        if i == max_new_tokens - 1 or (eos and not bool(live.any())):
            break
        start = time.perf_counter()
        nxt = _choose(runner.step(nxt), sample, temperature, top_k, generator)
        _sync(device)
        steps.append(time.perf_counter() - start)
        if on_step is not None:
            on_step()
    return Decoded(torch.cat([prompt, torch.stack(chosen, dim=1)], dim=1), ttft, steps)
