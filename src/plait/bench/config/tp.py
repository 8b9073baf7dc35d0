"""``plait bench tp``'s settings (``TPBenchConfig``): the model, the systems compared, the
steps, the DLRM part's sizes and the data × tensor mesh."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...runtime.fields import help_meta as _h
from ...training.config import TrainConfig

__all__ = ["TPBenchConfig", "EmbBenchConfig", "SYSTEMS", "COMPILED", "DP_SYSTEMS", "MODELS",
           "HF_PLANS", "QUICK_TP"]

HF_PLANS = ("auto", "layers")  # hf-llama: the model's own plan, or its decoder layers' only


SYSTEMS = ("plait", "plait-plain", "pytorch-tp")


COMPILED = ("plait-compiled", "pytorch-tp-compiled")  # --compile: the two under torch.compile


DP_SYSTEMS = ("plait", "plait-plain")  # under --dp above 1


MODELS = ("gpt", "hf-llama")


# per model where they differ: the GPT bench's sizes; the Llama of issue 23 (4 layers of
# width 256), whose all-reduces are a larger share of a step than the 2 × 512 GPT's
SIZES = {"gpt": dict(n_layer=2, n_embd=512), "hf-llama": dict(n_layer=4, n_embd=256)}


QUICK_TP = dict(batch_size=8, warmup=2, steps=8)


@dataclass(frozen=True, kw_only=True)
class TPBenchConfig:
    """The model, the data and the steps; each field's help is its CLI flag's help."""

    systems: tuple[str, ...] = field(default=SYSTEMS, metadata=_h(
        "what to train: " + ", ".join(SYSTEMS + COMPILED)))
    compile: bool = field(default=False, metadata=_h(
        "hf-llama: also train plait-compiled and pytorch-tp-compiled, the same models under "
        "torch.compile (inductor; compiled in the warm-up steps)"))
    model: str = field(default="gpt", metadata=_h(
        "gpt (plait's GPT) or hf-llama (a transformers LlamaForCausalLM from a config, "
        "grouped-query attention, no download; needs plait[hf])"))
    n_layer: int | None = field(default=None, metadata=_h(
        "transformer blocks (default: 2 for gpt, 4 for hf-llama)"))
    n_head: int = field(default=8, metadata=_h("attention heads"))
    n_kv_head: int = field(default=2, metadata=_h("hf-llama: key/value heads (grouped-query)"))
    n_embd: int | None = field(default=None, metadata=_h(
        "model width (default: 512 for gpt, 256 for hf-llama)"))
    hf_plan: str = field(default="auto", metadata=_h(
        "hf-llama: auto (the model's own plan, embedding and LM head split by vocabulary too) "
        "or layers (the decoder layers' entries only; embedding and LM head replicated)"))
    seq_len: int = field(default=128, metadata=_h("characters per sequence"))
    batch_size: int = field(default=16, metadata=_h("sequences per step (the same on every rank)"))
    warmup: int = field(default=3, metadata=_h("untimed steps first (they still train)"))
    steps: int = field(default=12, metadata=_h("timed steps (median reported)"))
    compare_steps: int = field(default=5, metadata=_h("steps over which losses are compared"))
    lr: float = field(default=1e-3, metadata=_h("learning rate (constant)"))
    optimizer: str = field(default="adamw", metadata=_h("adamw (weight decay 0) or sgd"))
    seed: int = field(default=0, metadata=_h("seed of the weights and the data order"))
    microbatches: int = field(default=2, metadata=_h(
        "gpt's plait: micro-batches interleaved, one's all-reduces under the next one's compute "
        "(1: off; plait.nn.apply_tp(microbatches=))"))
    dlrm: bool = field(default=True, metadata=_h(
        "(--model gpt) also DLRM embeddings: plait's ShardedEmbeddingBag, fused and plain, "
        "against each other and TorchRec's sharded EmbeddingBagCollection (TorchRec skipped, "
        "with the reason, where it does not import)"))
    emb_tables: int = field(default=4, metadata=_h("DLRM: tables (whole tables per rank)"))
    emb_rows: int = field(default=50_000, metadata=_h("DLRM: rows per table"))
    emb_dim: int = field(default=64, metadata=_h("DLRM: embedding dim"))
    emb_batch: int = field(default=4096, metadata=_h("DLRM: bags per table per step"))
    emb_pool: int = field(default=8, metadata=_h("DLRM: ids per bag"))
    emb_lr: float = field(default=20_000.0, metadata=_h(
        "DLRM: SGD learning rate (the loss is a mean over batch × tables × dim elements)"))
    emb_chunks: int = field(default=0, metadata=_h(
        "DLRM: plait-emb's pieces (0: auto, the cost model's choice)"))
    dp: int = field(default=1, metadata=_h(
        "data-parallel replicas (PyTorch's DDP or FSDP2 around plait's TP); above 1 the bench "
        "trains plait's fused path (--systems plait, plait-plain) under both placements, tp "
        "inside a host and tp across hosts, and prints each beside the simulator's prediction"))
    tp: int | None = field(default=None, metadata=_h(
        "ranks in one tensor-parallel group; --dp × --tp must be the ranks (default: ranks / "
        "--dp)"))
    extra: dict = field(default_factory=dict)  # where it ran (filled by the launcher)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model!r}: choose from {', '.join(MODELS)}")
        for name, value in SIZES[self.model].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        unknown = [s for s in self.systems if s not in SYSTEMS + COMPILED]
        if unknown or not self.systems:
            raise ValueError(f"--systems {list(self.systems)}: choose from "
                             f"{list(SYSTEMS + COMPILED)}")
        if self.compile or set(self.systems) & set(COMPILED):
            if self.model != "hf-llama":
                raise ValueError("--compile trains the transformers Llama: give --model hf-llama")
            more = tuple(s for s in COMPILED if s not in self.systems) if self.compile else ()
            object.__setattr__(self, "systems", (*self.systems, *more))
        sizes = {k: getattr(self, k) for k in ("n_layer", "n_head", "n_kv_head", "n_embd",
                                               "seq_len", "batch_size", "steps",
                                               "compare_steps")}
        if min(sizes.values()) < 1 or self.warmup < 0 or self.lr <= 0:
            raise ValueError(f"sizes and steps must be positive, warmup ≥ 0, lr > 0: "
                             f"{sizes}, warmup {self.warmup}, lr {self.lr}")
        for name in ("emb_tables", "emb_rows", "emb_dim", "emb_batch", "emb_pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.emb_chunks < 0:
            raise ValueError(f"--emb-chunks must be ≥ 0 (0: auto), got {self.emb_chunks}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer must be adamw or sgd, got {self.optimizer!r}")
        self.train_config().gpt_config(97)  # refuse n_embd not divisible by n_head now
        self._check_mesh()
        if self.model == "hf-llama":
            self._check_hf()

    def _check_mesh(self) -> None:
        for name in ("dp", "tp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        if self.dp == 1:
            return
        if self.systems == SYSTEMS:  # the default: the placements of plait's fused path
            object.__setattr__(self, "systems", ("plait",))
        if not set(self.systems) <= set(DP_SYSTEMS):
            raise ValueError(f"--dp {self.dp} compares placements of {' and '.join(DP_SYSTEMS)}, "
                             f"not --systems {','.join(self.systems)}")
        if self.batch_size % self.dp:
            raise ValueError(f"--batch-size {self.batch_size} does not split evenly over --dp "
                             f"{self.dp} replicas")

    @property
    def mesh_ranks(self) -> int | None:
        """--dp × --tp where --tp is given (the ranks the run needs), else None."""
        return self.dp * self.tp if self.tp is not None else None

    def resolved(self, world: int) -> "TPBenchConfig":
        """This config on ``world`` ranks, ``tp`` filled in (checked by :meth:`check_world`)."""
        self.check_world(world)
        return replace(self, tp=world // self.dp)

    def _check_hf(self) -> None:
        if self.n_head % self.n_kv_head:
            raise ValueError(f"--n-head {self.n_head} is not a multiple of --n-kv-head "
                             f"{self.n_kv_head} (grouped-query attention)")
        if self.hf_plan not in HF_PLANS:
            raise ValueError(f"--hf-plan {self.hf_plan!r}: choose from {', '.join(HF_PLANS)}")
        from ..tp_hf import transformers_missing  # transformers loads torch: only for hf-llama

        missing = transformers_missing()
        if missing is not None:
            raise ValueError(f"--model hf-llama needs transformers (pip install 'plait[hf]'): "
                             f"{missing}")

    @property
    def runs_dlrm(self) -> bool:
        return self.dlrm and self.model == "gpt" and self.dp == 1

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def train_config(self, overlap: bool = True) -> TrainConfig:
        return TrainConfig(model="gpt", steps=self.total_steps, batch_size=self.batch_size,
                           lr=self.lr, seq_len=self.seq_len, n_layer=self.n_layer,
                           n_head=self.n_head, n_embd=self.n_embd, overlap=overlap, seed=self.seed,
                           microbatches=self.microbatches if overlap else 1)

    def emb_config(self) -> EmbBenchConfig:
        return EmbBenchConfig(tables=self.emb_tables, rows=self.emb_rows, dim=self.emb_dim,
                              batch=self.emb_batch, pool=self.emb_pool, lr=self.emb_lr,
                              seed=self.seed, chunks=self.emb_chunks or "auto")

    def check_world(self, world: int) -> None:
        tp = self.tp if self.tp is not None else world // self.dp
        if self.dp * tp != world:
            raise ValueError(f"--dp {self.dp} × --tp {tp} = {self.dp * tp} ranks, but the run "
                             f"has {world} (--ranks, or --hosts)")
        if self.dp > 1:
            self._check_tp(tp)
            return
        if self.runs_dlrm and self.emb_tables % world:
            raise ValueError(f"--emb-tables {self.emb_tables} do not split evenly over {world} "
                             "ranks (TorchRec's table-wise plan and plait's are compared as equals)")
        if self.n_head % world:
            raise ValueError(f"--n-head {self.n_head} does not split over {world} ranks: PyTorch "
                             "TP shards evenly, so the head count must be a multiple of the ranks")
        if self.model == "hf-llama" and self.n_kv_head % world:
            raise ValueError(f"--n-kv-head {self.n_kv_head} does not split over {world} ranks: "
                             "PyTorch TP shards k_proj/v_proj evenly, so the KV-head count "
                             "must be a multiple of the ranks")

    def _check_tp(self, tp: int) -> None:
        if tp < 2:
            raise ValueError(f"--dp {self.dp} × --tp {tp}: with one rank per tp group both "
                             "placements are the same; the comparison needs --tp 2 or more")
        if self.n_head % tp:
            raise ValueError(f"--n-head {self.n_head} does not split over --tp {tp} ranks")
        if self.model == "hf-llama" and self.n_kv_head % tp:
            raise ValueError(f"--n-kv-head {self.n_kv_head} does not split over --tp {tp} ranks")


@dataclass(frozen=True, kw_only=True)
class EmbBenchConfig:
    """bench tp's DLRM part: the embedding tables, the batch and the optimizer."""

    tables: int = 4
    rows: int = 50_000
    dim: int = 64
    batch: int = 4096   # bags per table per step, whole batch
    pool: int = 8       # ids per bag
    lr: float = 20000.0  # the loss is a mean over B·T·D elements, so its gradients are tiny
    seed: int = 0
    chunks: int | str = "auto"  # plait-emb's pieces: "auto" (the cost model) or a count
