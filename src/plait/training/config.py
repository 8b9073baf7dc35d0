"""``TrainConfig``: what ``plait train`` trains, and how (each field's doc is its flag's
``--help``); refused in one line, naming the flag, before any rank starts."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from ..models.config import DLRMConfig, GPTConfig
from ..plan import ShardPlan, head_split
from ..runtime.fields import help_meta as _h

__all__ = ["TrainConfig", "MODELS", "PRESETS", "HF_MODELS", "HF_PLAN_KINDS", "BALANCE",
           "DP_MODELS", "BALANCED_MODELS", "hf_intermediate", "require_transformers"]

HF_MODELS = ("hf-llama", "hf-mixtral")
HF_PLAN_KINDS = {"hf-llama": ("heads", "mlp"), "hf-mixtral": ("heads", "experts")}
"""What ``--plans`` may split: transformers' own plan splits attention by heads (KV-head
groups) and Llama's MLP by columns; Mixtral's experts go whole to ranks (expert parallel)."""
MODELS = ("gpt", "moe", "dlrm", *HF_MODELS)
BALANCE = ("even", "resize", "migrate", "semi")
DP_MODELS = ("gpt", "hf-llama")
"""Models ``--dp`` above 1 is tested with (loss against one process on the global batch)."""
BALANCED_MODELS = ("gpt", "moe", "hf-llama", "hf-mixtral")
"""Models whose sharded dims (attention heads, MLP columns) the balancer moves; in moe and
hf-mixtral the experts too (placed by routed load and speed, hot ones replicated)."""
# what an unset flag means, per model: tiny enough to train here in about a minute
PRESETS = {
    "gpt": dict(steps=400, batch_size=16, lr=3e-3, n_head=4),
    "moe": dict(steps=400, batch_size=16, lr=3e-3, n_head=4),
    "dlrm": dict(steps=600, batch_size=256, lr=1e-2, n_head=4),
    "hf-llama": dict(steps=300, batch_size=16, lr=3e-3, n_head=8, kv_heads=2),
    # measured on 2 loaded cores, 2 ranks: a step 0.22-0.40 s (llama), 0.35-0.46 s (mixtral)
    "hf-mixtral": dict(steps=150, batch_size=16, lr=3e-3, n_head=8, kv_heads=2),
}



@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = field(default="gpt", metadata=_h(
        "gpt, moe (a GPT whose MLPs are MoE), dlrm, or a transformers model built from a "
        "config: hf-llama (grouped-query attention), hf-mixtral (its MLPs are experts)"))
    steps: int | None = field(default=None, metadata=_h(
        "optimizer steps (default 400 for the GPTs, 300 for hf-llama, 150 for hf-mixtral, "
        "600 for dlrm)"))
    batch_size: int | None = field(default=None, metadata=_h("sequences (GPT, hf-*) or samples "
                                                             "(DLRM) per step (default 16 / 256)"))
    lr: float | None = field(default=None, metadata=_h("peak learning rate of AdamW (default 3e-3 "
                                                       "for the GPTs and hf-*, 1e-2 for dlrm)"))
    seq_len: int = field(default=64, metadata=_h("GPT, hf-*: characters per sequence"))
    n_layer: int = field(default=2, metadata=_h("GPT, hf-*: transformer blocks"))
    n_head: int | None = field(default=None, metadata=_h(
        "GPT, hf-*: attention (query) heads (default 4; 8 for hf-*)"))
    kv_heads: int | None = field(default=None, metadata=_h(
        "hf-*: key/value heads, each read by n_head / kv_heads query heads (default 2)"))
    n_embd: int = field(default=128, metadata=_h("GPT, hf-*: model width"))
    n_experts: int = field(default=4, metadata=_h("moe, hf-mixtral: experts per MoE layer"))
    top_k: int = field(default=2, metadata=_h("moe, hf-mixtral: experts per token"))
    overlap: bool = field(default=True, metadata=_h("fused compute–collective operators "
                                                    "(--no-overlap: the plain path)"))
    sequence_parallel: bool = field(default=False, metadata=_h("GPT: sequence-parallel "
                                                               "activations between linears"))
    chunks: str = field(default="auto", metadata=_h("pieces per fused operator: auto or a number"))
    microbatches: int = field(default=1, metadata=_h(
        "gpt: cut each batch into this many micro-batches whose blocks take turns, one's "
        "all-reduces on the wire while the next computes (fused, not sequence-parallel)"))
    plans: tuple[str, ...] = field(default=(), metadata=_h(
        "uneven partition plans, KIND=A:B:…, e.g. heads=3:1,mlp=320:192 (kinds: heads, mlp, "
        "experts, seq, tables, batch; hf-*: heads count KV-head groups)"))
    eval_batches: int = field(default=8, metadata=_h("held-out batches evaluated at the end"))
    seed: int = field(default=0, metadata=_h("seed of the weights and the data order"))
    dp: int = field(default=1, metadata=_h(
        "data-parallel replicas (gpt, hf-llama): each takes an equal share of every batch's "
        "rows; --dp × --tp must be the number of ranks"))
    tp: int | None = field(default=None, metadata=_h(
        "ranks in one tensor-parallel group (default: ranks / --dp)"))
    tp_across_hosts: bool = field(default=False, metadata=_h(
        "a tp group's ranks --dp apart, so tensor parallelism crosses hosts and each replica "
        "is consecutive ranks (default: a tp group is consecutive ranks, inside a host)"))
    balance: str = field(default="even", metadata=_h(
        "balancing policy run in the loop: even (no balancer), resize, migrate, semi "
        "(gpt, hf-llama; with --dp > 1 data parallelism is DDP: add --no-overlap unless "
        "--sequence-parallel)"))
    checkpoint_dir: str | None = field(default=None, metadata=_h(
        "save checkpoints (model, optimizer, step, data position, RNG states) under DIR"))
    checkpoint_every: int = field(default=50, metadata=_h("steps between checkpoints"))
    checkpoint_keep: int = field(default=2, metadata=_h("newest checkpoints kept"))
    resume: bool = field(default=False, metadata=_h(
        "continue from the newest checkpoint in --checkpoint-dir (none there: from step 0)"))
    extra: dict = field(default_factory=dict)  # where it ran (filled by the launcher)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        hf = self.model in HF_MODELS
        if self.kv_heads is not None and not hf:
            raise ValueError(f"--kv-heads applies to --model {' and '.join(HF_MODELS)}, not to "
                             f"{self.model}")
        for key, value in PRESETS[self.model].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        for name in ("steps", "batch_size", "seq_len", "n_layer", "n_head", "n_embd",
                     "n_experts", "top_k") + (("kv_heads",) if hf else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.eval_batches < 0:
            raise ValueError(f"--eval-batches must be 0 or more, got {self.eval_batches}")
        if self.chunks != "auto" and not (str(self.chunks).isdigit() and int(self.chunks) >= 1):
            raise ValueError(f"--chunks must be 'auto' or a positive number, got {self.chunks!r}")
        if self.sequence_parallel and self.model not in ("gpt", "moe"):
            raise ValueError(f"--sequence-parallel applies to the GPT models (gpt, moe), not "
                             f"to {self.model}")
        if self.microbatches < 1:
            raise ValueError(f"--microbatches must be positive, got {self.microbatches}")
        if self.microbatches > 1 and (self.model != "gpt" or self.sequence_parallel
                                      or not self.overlap):
            raise ValueError(f"--microbatches {self.microbatches} applies to --model gpt, fused "
                             "(not --no-overlap) and not --sequence-parallel")
        _check_parallel(self)
        _check_checkpoint_flags(self)
        self.shard_plans()  # refuse a malformed --plans now
        if self.model in ("gpt", "moe"):
            self.gpt_config(97)  # refuse --n-embd that --n-head does not divide, now
        if hf:
            _check_hf_sizes(self)
            require_transformers(self.model)

    @property
    def chunk_count(self):
        return "auto" if self.chunks == "auto" else int(self.chunks)

    def shard_plans(self) -> dict[str, ShardPlan]:
        plans = {}
        for entry in self.plans:
            kind, _, sizes = entry.partition("=")
            try:
                plans[kind.strip()] = ShardPlan(tuple(int(s) for s in sizes.split(":")))
            except ValueError:
                raise ValueError(f"cannot read --plans entry {entry!r}; write KIND=A:B, "
                                 "e.g. heads=3:1") from None
        return plans

    def check_plans(self, world: int) -> None:
        """Refuse, before anything starts, a plan that does not fit the model on ``world``
        ranks."""
        if self.model in HF_MODELS:
            allowed = HF_PLAN_KINDS[self.model]
            plans = self.shard_plans()
            for kind in plans:
                if kind not in allowed:
                    raise ValueError(f"--plans {kind}=… does not apply to --model {self.model} "
                                     f"(it takes {', '.join(allowed)})")
            _check_hf_plans(self, plans, world)
            return
        gpt = self.gpt_config(97)
        dims = {"heads": (gpt.n_head, "heads"), "mlp": (gpt.mlp_ratio * gpt.n_embd, "columns"),
                "experts": (self.n_experts, "experts"), "seq": (self.seq_len, "positions"),
                "tables": (len(DLRMConfig().table_sizes), "tables"),
                "batch": (self.batch_size, "samples")}
        allowed = {"dlrm": ("tables", "batch"), "gpt": ("heads", "mlp", "seq"),
                   "moe": ("heads", "experts", "seq")}[self.model]
        for kind, plan in self.shard_plans().items():
            if kind not in allowed:
                raise ValueError(f"--plans {kind}=… does not apply to --model {self.model} "
                                 f"(it takes {', '.join(allowed)})")
            total, what = dims[kind]
            plan.check(total, world, what=what, layer=f"--plans {kind}",
                       allow_empty=kind in ("seq", "batch"))

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        experts = self.n_experts if self.model == "moe" else 0
        return GPTConfig(vocab_size=vocab_size, block_size=self.seq_len, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, n_experts=experts,
                         top_k=self.top_k, mlp_ratio=2 if experts else 4)


def _check_parallel(cfg) -> None:
    """Refuse, in one line, what ``--dp``, ``--tp``, ``--tp-across-hosts`` and ``--balance``
    cannot do with the rest of ``cfg`` (called from ``TrainConfig.__post_init__``)."""
    for name in ("dp", "tp"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be positive, got {value}")
    if cfg.balance not in BALANCE:
        raise ValueError(f"--balance must be one of {', '.join(BALANCE)}, got {cfg.balance!r}")
    if cfg.dp > 1 and cfg.model not in DP_MODELS:
        raise ValueError(f"--dp {cfg.dp} applies to --model {' and '.join(DP_MODELS)}, not to "
                         f"{cfg.model}")
    if cfg.dp > 1 and cfg.batch_size % cfg.dp:
        raise ValueError(f"--batch-size {cfg.batch_size} does not split evenly over --dp "
                         f"{cfg.dp} replicas")
    if cfg.balance != "even" and cfg.model not in BALANCED_MODELS:
        raise ValueError(f"--balance {cfg.balance} applies to --model "
                         f"{' and '.join(BALANCED_MODELS)}, not to {cfg.model} (its experts or "
                         "tables are not balanced yet)")
    if cfg.balance != "even" and cfg.dp > 1 and cfg.overlap and not cfg.sequence_parallel:
        raise ValueError(f"--balance {cfg.balance} with --dp {cfg.dp} needs --no-overlap: after "
                         "a migration data parallelism is rebuilt by DDP (FSDP2's re-sharding "
                         "is not built), and DDP does not see the weight gradients fused "
                         "row-parallel layers add outside autograd")



def require_transformers(model: str) -> None:
    """Refuse in one line, before anything starts, an ``hf-*`` model without transformers."""
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"--model {model} needs transformers, which is not installed: "
                         "pip install 'plait[hf]'")



def _check_hf_sizes(cfg) -> None:
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



def _check_checkpoint_flags(cfg) -> None:
    """Refuse impossible checkpoint flags (called by ``TrainConfig``)."""
    for name in ("checkpoint_every", "checkpoint_keep"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                             f"got {value!r}")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir DIR (the checkpoints to resume from)")


def _check_hf_plans(cfg, plans: dict[str, ShardPlan], world: int) -> None:
    """Each dim ``parallelize`` will split, given (``--plans``) or even, fits ``world`` ranks."""
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


def hf_intermediate(cfg) -> int:
    """The MLP's hidden width: 2 × width, per expert for Mixtral (SwiGLU's three matrices of
    that width hold 6 × width² weights, near the GPT's 4 × width GELU MLP's 8 × width²)."""
    return 2 * cfg.n_embd
