"""transformers models for ``plait train --model hf-llama|hf-mixtral``: built from a config, no
download, made tensor-parallel by ``plait.parallelize(model, plan="auto")``.

``hf_model(cfg, vocab_size)`` is the single-process model (a ``LlamaForCausalLM`` or a
``MixtralForCausalLM``, random weights from ``cfg.seed``); ``build_hf`` makes it parallel;
``hf_loss`` / ``hf_logits_loss`` score next-character prediction on the char corpus exactly
as the GPT does (every position, not transformers' own shifted ``labels`` loss, which
drops the last one). What the model or ``parallelize`` would refuse later is refused by
``TrainConfig`` (:mod:`.config`) before any rank starts, naming the flags.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import hf_intermediate, require_transformers

__all__ = ["hf_model", "build_hf", "hf_loss", "hf_logits_loss"]

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
