"""Tiny transformers models with random weights, built from any config class (no download).

``tiny_config(model_type)`` starts from the config class's defaults and shrinks
every size it knows by name (widths, heads, experts, ranks of low-rank
projections, vocabulary, positions) to a few units; per-layer lists
(``layer_types``, ``mlp_layer_types``, …) keep one layer of each distinct kind
(at least 2 layers, at most 4), so a hybrid model keeps its mix. Per-family
overrides (``OVERRIDES``) only where the generic sizes fail. ``tiny_model``
builds the causal LM from it with a fixed seed, in float64 where its kernels
take float64 (``experts_implementation="eager"``), and reports why a model
cannot be built (``NotBuilt``) apart from anything plait does.

Sizes: width 64, 4 query heads of 16 over 2 KV heads, MLP 96, 4 experts
(top 2) of 32, vocabulary 128, 2 layers. 2 KV heads on 3 ranks are cut into
sub-groups (K/V copied), on 2 ranks whole groups: both of plait's attention
paths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["tiny_config", "tiny_model", "NotBuilt", "tp_model_types", "VOCAB"]

VOCAB = 128
_SIZES: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "n_embd": 64, "d_model": 64,
    "intermediate_size": 96, "ffn_hidden_size": 96, "n_inner": 96,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "kv_channels": 16,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "model_max_length": 64,
    "original_max_position_embeddings": 64,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "expert_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 32,
    "dense_intermediate_size": 96, "mlp_only_intermediate_size": 96,
    "intermediate_size_mlp": 96,
    # multi-head latent attention
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16, "o_lora_rank": 16, "o_groups": 2,
    # indexers, linear attention, state spaces
    "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2, "index_num_heads": 2,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_head_dim": 8, "linear_num_heads": 4,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_chunk_size": 16,
    "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "chunk_size": 16,
    "mamba_d_ssm": 64, "mamba_dt_rank": 8, "n_groups": 1,
    # sliding windows and the like
    "sliding_window": 8, "sliding_window_size": 8, "attention_chunk_size": 8,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    "rotary_dim": 8, "query_pre_attn_scalar": 16,
    "vocab_size_per_layer_input": VOCAB, "unpadded_vocab_size": VOCAB,
    "hidden_size_per_layer_input": 8,
    "laurel_rank": 8, "num_kv_shared_layers": 0,
    "global_head_dim": 16, "block_multiple_of": 32, "gated_norm_rank": 8, "loop_gate_rank": 8,
    "hc_lowrank": 8,
}
# sizes a config may leave None for "derive it" or "absent": given all the same
_MISSING = {"head_dim", "num_key_value_heads", "n_routed_experts", "n_shared_experts",
            "num_experts_per_tok", "num_experts", "intermediate_size"}
_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
_PER_LAYER_MAX = 4

# family-specific fixes where the generic sizes do not build
OVERRIDES: dict[str, dict[str, Any]] = {
    # hybrids whose attention layers the defaults place beyond the second layer
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "use_mamba_kernels": False},
    # its sliding layers' attention sizes come from swa_* keywords (64 heads of 256)
    "dots3_note_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4,
                        "swa_q_lora_rank": 16, "swa_kv_lora_rank": 16, "swa_head_dim": 16,
                        "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 16},
    "dory": {"n_input_layers": 1, "n_output_layers": 1},  # defaults 8 each, of 2 layers
    # its rotary embedding reads rope_parameters per layer type; the defaults are not
    "cohere_compass_text": {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # an indexer whose sizes default to None; n-gram tables of 20M rows by default
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 8, "indexer_compress_ratio": 2,
                       "ngram_vocab_size_base": 256, "split_ngram_parts": 2,
                       "heads_per_ngram": 2},
}


def tp_model_types() -> list[str]:
    """Every causal-LM model type whose config class ships a tensor-parallel plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[name]
        except KeyError:
            continue
        if getattr(cls, "base_model_tp_plan", None):
            out.append(name)
    return out


class NotBuilt(Exception):
    """The tiny model cannot be built or run on one CPU process, for a reason outside plait."""


def _layers_kept(default: dict) -> tuple[int, list[int]] | None:
    """Which of the default config's layers to keep: one of each distinct per-layer kind."""
    n = default.get("num_hidden_layers")
    if not isinstance(n, int):
        return None
    lists = [v for v in default.values() if isinstance(v, list) and len(v) == n and n > 2]
    if not lists:
        return None
    seen, keep = set(), []
    for i in range(n):
        kind = tuple(repr(v[i]) for v in lists)
        if kind not in seen:
            seen.add(kind)
            keep.append(i)
    keep = keep[:_PER_LAYER_MAX]
    while len(keep) < 2:
        keep.append(next(i for i in range(n) if i not in keep))
    return n, sorted(keep)


def tiny_config(model_type: str, **extra):
    """The tiny config of ``model_type`` (see the module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kw = _tiny_kwargs(cls)
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type):  # a composite config (text, vision, audio): each one tiny
            kw[name] = {**_tiny_kwargs(sub), **kw.get(name, {})}
    kw["experts_implementation"] = "eager"  # grouped_mm takes no float64 on CPU
    kw.update(OVERRIDES.get(model_type, {}))
    kw.update(extra)
    try:
        return cls(**kw)
    except Exception as err:  # noqa: BLE001
        raise NotBuilt(f"its tiny config does not build: {type(err).__name__}: "
                       f"{_short(err)}") from None


def _tiny_kwargs(cls) -> dict[str, Any]:
    """The sizes of ``cls``'s defaults that ``_SIZES`` knows, shrunk; per-layer lists cut."""
    try:
        inst = cls()
    except Exception as err:  # noqa: BLE001
        raise NotBuilt(f"its config's defaults do not build: {type(err).__name__}: "
                       f"{_short(err)}") from None
    names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) \
        else list(inst.to_dict())
    default = {}
    for name in names:
        try:
            default[name] = getattr(inst, name, None)
        except Exception:  # noqa: BLE001 - a per-layer attribute, not readable globally
            default[name] = 0  # a size like any other: shrunk below
    kw: dict[str, Any] = {}
    for name, value in _SIZES.items():
        if name not in default:
            continue
        have = default[name]
        if (isinstance(have, int) and not isinstance(have, bool)) or \
                (have is None and name in _MISSING):
            kw[name] = value
    if "kv_lora_rank" in kw:  # multi-head latent attention: K/V per query head
        if "head_dim" in kw and "qk_rope_head_dim" in kw:
            kw["head_dim"] = kw["qk_rope_head_dim"]  # the rotary part is its "head_dim"
        for name in ("num_key_value_heads", "swa_num_key_value_heads"):
            if name in kw:
                kw[name] = kw["num_attention_heads"]
    if {"mamba_n_heads", "mamba_d_head", "mamba_expand"} <= set(default) and \
            "hidden_size" in kw and "mamba_d_ssm" not in kw:
        kw["mamba_d_head"] = default["mamba_expand"] * kw["hidden_size"] // kw["mamba_n_heads"]
    for name, value in default.items():  # the reference and the copy draw no random masks
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float) and value:
            kw[name] = 0.0
    for name in _TOKENS:
        if name in default and default[name] is not None:
            kw[name] = {"pad_token_id": 0, "bos_token_id": 1}.get(name, 2)
    kept = _layers_kept(default)
    if kept is not None:
        n, keep = kept
        for name, value in default.items():
            if isinstance(value, list) and len(value) == n:
                kw[name] = [value[i] for i in keep]
        for name in ("num_hidden_layers", "n_layer", "num_layers"):
            if name in kw:
                kw[name] = len(keep)
    return kw


def tiny_model(model_type: str, dtype=torch.float64, seed: int = 0, **extra):
    """The causal LM of ``model_type`` at tiny size, random weights from ``seed``, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **extra)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    except Exception as err:  # noqa: BLE001
        raise NotBuilt(f"the model does not build: {type(err).__name__}: {_short(err)}") from None
    return model.to(dtype).eval().train()


def _short(err: Exception) -> str:
    return str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
