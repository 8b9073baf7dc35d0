"""``plait generate``: a transformers causal LM decoding tensor-parallel on N ranks.

The model is built from a config (``hf-llama``, ``hf-mixtral``: random weights, no
download; sizes from the flags, one seed on every rank) or loaded from a checkpoint
directory, each rank reading its shards (:func:`plait.from_pretrained`). It is made
parallel by its own plan (``plait.parallelize(model, "auto")``) and decodes the prompts
(token ids; prompts of different lengths padded on the left, each row's positions its own)
with :func:`plait.inference.decode.decode`. Everything a user can get wrong (a prompt file,
a model name, more tokens than the model's positions, ids outside its vocabulary) is
checked by :meth:`GenerateConfig.check` before any rank starts.
"""

from __future__ import annotations

import statistics

import torch

from .config import MODELS, GenerateConfig
from .prompts import read_prompts, text_prompts, tokenizer_of

__all__ = ["GenerateConfig", "MODELS", "build_model", "generate_rank", "read_prompts",
           "stopping", "text_prompts", "tokenizer_of"]


# random weights have no end-of-sequence token (the config classes' defaults, 1 and 2, are a
# tokenizer's): a built model decodes every token asked for, unless --eos-id names one
_NO_SPECIAL = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def build_model(cfg) -> torch.nn.Module:
    """The single-device model from its config, seeded (``cfg`` has the config fields)."""
    if cfg.model == "hf-mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd,
                               intermediate_size=cfg.n_embd * 2,
                               num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                               num_key_value_heads=cfg.n_kv_head, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=cfg.max_positions,
                               experts_implementation="eager", **_NO_SPECIAL)
        torch.manual_seed(cfg.seed)
        return MixtralForCausalLM(config).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd,
                         intermediate_size=cfg.n_embd * 11 // 4, num_hidden_layers=cfg.n_layer,
                         num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                         max_position_embeddings=cfg.max_positions, tie_word_embeddings=False,
                         attn_implementation="sdpa", **_NO_SPECIAL)
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config).eval()


def stopping(model, eos_id: int | None) -> dict:
    """``decode``'s ``eos_token_id`` and ``pad_token_id``: ``eos_id`` where given, else the
    model's generation config's (as transformers' ``generate`` reads them)."""
    config = getattr(model, "generation_config", None)
    eos = eos_id if eos_id is not None else getattr(config, "eos_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    return {"eos_token_id": eos, "pad_token_id": pad}


def _padded(prompts) -> tuple[torch.Tensor, torch.Tensor | None]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    return ids, (None if bool(mask.all()) else mask)


def generate_rank(cfg: GenerateConfig) -> dict:
    """On every rank: build or load, parallelize, decode; the tokens and the timings."""
    import torch.distributed as dist

    from ..ops import explain
    from ..ops.context import get_context, transport_of
    from ..parallel import applied, parallelize
    from ..runtime.timing import agreed_max
    from .decode import step_figures
    from .serve import serve

    torch.set_num_threads(1)
    if cfg.model in MODELS:
        model = parallelize(build_model(cfg), "auto")
    else:
        from ..checkpoint import from_pretrained

        model = from_pretrained(cfg.model, "auto")
    if dist.get_world_size() > 1:  # chunks="auto"'s one-time measurement, before the clock
        get_context().calibration()  # starts: not the first token's (2.5 s of it on gloo)
    sampling = dict(sample=cfg.sample, temperature=cfg.temperature, top_k=cfg.top_k,
                    seed=cfg.seed, compiled=cfg.compile, **stopping(model, cfg.eos_id))
    if cfg.requests == "each":
        batches = [(torch.tensor([p]), None) for p in cfg.prompts]
    else:
        batches = [_padded(cfg.prompts)]
    # one batch (its mask, where its prompts differ in length), or a request a prompt
    mask = batches[0][1] if len(batches) == 1 else None
    compile_s = None
    if cfg.compile:  # the compilation, before the clock starts: a decode of the same shapes
        import time

        from .decode import decode

        started = time.perf_counter()
        for ids, _ in batches[:1]:
            decode(model, ids, 2, attention_mask=mask, compiled=True,
                   cache_len=ids.shape[1] + cfg.max_new_tokens)
        compile_s = time.perf_counter() - started
    served = serve(model, [ids for ids, _ in batches], cfg.max_new_tokens, split=cfg.split,
                   tolerance=cfg.tolerance, attention_mask=mask, **sampling)
    requests, tokens = [], []
    for (ids, _), out in zip(batches, served):
        times = agreed_max([out.ttft_s, *out.step_s])
        tokens += [out.tokens[i, ids.shape[1]:].tolist() for i in range(ids.shape[0])]
        requests.append({
            "prompts": ids.shape[0], "ttft_ms": times[0] * 1e3,
            **step_figures(times[1:] or times[:1], ids.shape[0]),
            "split": {d.rsplit(".", 1)[-1]: list(s) for d, s in out.sizes.items()},
            "speeds": list(out.speeds) if out.speeds is not None else None,
            "gain": out.gain, "moved": out.moved, "placed": out.placed})
    first = requests[0]
    return {"tokens": tokens, "requests": requests,
            "ttft_ms": first["ttft_ms"], "ms_per_token": statistics.median(
                r["ms_per_token"] for r in requests),
            "p99_ms": max(r["p99_ms"] for r in requests),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in requests),
            "world_size": dist.get_world_size(), "parallel": applied(model)[:1],
            "compile_s": compile_s, "eos_token_id": sampling["eos_token_id"],
            "transport": transport_of(None).choice.name,
            "transport_reason": transport_of(None).choice.reason, "paths": explain(),
            "checks": get_context().checks if dist.get_world_size() > 1 else None}
