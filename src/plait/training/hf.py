"""transformers models for ``plait train --model hf-llama|hf-mixtral``: built from a config, no
download, made tensor-parallel by ``plait.parallelize(model, plan="auto")``.

``hf_model(cfg, vocab_size)`` is the single-process model (a ``LlamaForCausalLM`` or a
``MixtralForCausalLM``, random weights from ``cfg.seed``); ``build_hf`` makes it parallel;
``hf_loss`` / ``hf_logits_loss`` score next-character prediction on the char corpus exactly
as the GPT does (every position, not transformers' own shifted ``labels`` loss, which
drops the last one). ``check_hf_sizes`` and ``check_hf_plans`` refuse, before any rank
starts, what the model or ``parallelize`` would refuse later, naming the flags.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from ..plan import ShardPlan

__all__ = ["HF_MODELS", "HF_PLAN_KINDS", "require_transformers", "hf_model", "build_hf",
           "hf_loss", "hf_logits_loss", "check_hf_sizes", "check_hf_plans", "hf_intermediate"]

HF_MODELS = ("hf-llama", "hf-mixtral")
HF_PLAN_KINDS = {"hf-llama": ("heads", "mlp"), "hf-mixtral": ("heads", "experts")}
"""What ``--plans`` may split: transformers' own plan splits attention by heads (KV-head
groups) and Llama's MLP by columns; Mixtral's experts go whole to ranks (expert parallel)."""


def require_transformers(model: str) -> None:
    """Refuse in one line, before anything starts, an ``hf-*`` model without transformers."""
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"--model {model} needs transformers, which is not installed: "
                         "pip install 'plait[hf]'")


def hf_intermediate(cfg) -> int:
    """The MLP's hidden width: 2 × width, per expert for Mixtral (SwiGLU's three matrices of
    that width hold 6 × width² weights, near the GPT's 4 × width GELU MLP's 8 × width²)."""
    return 2 * cfg.n_embd


def check_hf_sizes(cfg) -> None:
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"--n-embd {cfg.n_embd} does not divide into --n-head {cfg.n_head} "
                         "heads of equal width")
    if (cfg.n_embd // cfg.n_head) % 2:
        raise ValueError(f"--n-embd {cfg.n_embd} / --n-head {cfg.n_head} gives heads "
                         f"{cfg.n_embd // cfg.n_head} wide; rotary embeddings need an even width")
    if cfg.n_head % cfg.kv_heads:
        raise ValueError(f"--kv-heads {cfg.kv_heads} must divide --n-head {cfg.n_head} "
                         "(grouped-query attention: each K/V head serves as many query heads)")
    if cfg.model == "hf-mixtral" and not 1 <= cfg.top_k <= cfg.n_experts:
        raise ValueError(f"--top-k {cfg.top_k} must be in [1, --n-experts {cfg.n_experts}]")


def check_hf_plans(cfg, plans: dict[str, ShardPlan], world: int) -> None:
    """Each dim ``parallelize`` will split, given (``--plans``) or even, fits ``world`` ranks."""
    from ..parallel.dims import head_split

    heads = plans.get("heads")
    try:  # attention counts KV-head groups, or sub-groups that each copy their K/V head
        head_split(cfg.n_head, cfg.kv_heads, world, None if heads is None else heads.total)
    except ValueError as err:
        where = "--plans heads" if heads is not None else \
            f"--n-head {cfg.n_head}, --kv-heads {cfg.kv_heads} on {world} ranks"
        raise ValueError(f"{where}: {err}") from None
    if heads is not None:
        heads.check(heads.total, world, what="heads", layer="--plans heads")
    dims = {"mlp": (hf_intermediate(cfg), "columns", "--n-embd"),
            "experts": (cfg.n_experts, "experts", "--n-experts")}
    for kind in HF_PLAN_KINDS[cfg.model]:
        if kind == "heads":
            continue
        total, what, flag = dims[kind]
        if kind in plans:
            plans[kind].check(total, world, what=what, layer=f"--plans {kind}")
        elif total < world:
            raise ValueError(f"{flag}: {total} {what} cannot give each of {world} ranks one")


def hf_model(cfg, vocab_size: int) -> torch.nn.Module:
    """The single-process transformers model of ``cfg`` from its seed, in the default dtype."""
    require_transformers(cfg.model)
    import transformers

    sizes = dict(vocab_size=vocab_size, hidden_size=cfg.n_embd,
                 intermediate_size=hf_intermediate(cfg), num_hidden_layers=cfg.n_layer,
                 num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
                 max_position_embeddings=cfg.seq_len, tie_word_embeddings=False, use_cache=False)
    if cfg.model == "hf-llama":
        config = transformers.LlamaConfig(**sizes)
        make = transformers.LlamaForCausalLM
    else:
        # eager experts: the default kernel (grouped_mm) takes no float64 on CPU; a parallel
        # run replaces the experts with plait's expert-parallel layer either way
        config = transformers.MixtralConfig(**sizes, num_local_experts=cfg.n_experts,
                                            num_experts_per_tok=cfg.top_k,
                                            experts_implementation="eager")
        make = transformers.MixtralForCausalLM
    torch.manual_seed(cfg.seed)
    return make(config).to(torch.get_default_dtype())


def build_hf(cfg, group=None, vocab_size: int = 97) -> torch.nn.Module:
    """``hf_model`` made tensor-parallel on ``group`` by its own plan (``plan="auto"``), with
    ``--plans``' uneven shares, ``--overlap`` and ``--chunks``."""
    from ..parallel import parallelize

    return parallelize(hf_model(cfg, vocab_size), "auto", group=group,
                       shards=cfg.shard_plans(), overlap=cfg.overlap, chunks=cfg.chunk_count)


def hf_logits_loss(model, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, S, V], the mean cross-entropy of every position against ``y``)."""
    logits = model(input_ids=x, use_cache=False).logits  # [B, S, V], gathered on every rank
    return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


def hf_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return hf_logits_loss(model, x, y)[1]
