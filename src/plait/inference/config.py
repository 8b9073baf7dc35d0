"""``plait generate``'s settings (``GenerateConfig``): the model (one plait builds, or a
checkpoint directory), the decoding, the requests and the split; and every refusal the flags
and the checkpoint's files decide before any rank starts (:meth:`GenerateConfig.check`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from ..plan import head_split
from ..runtime.fields import help_meta as _h
from ..runtime.slow.straggler import once_per_rank

__all__ = ["GenerateConfig", "MODELS", "SPLITS"]

SPLITS = ("even", "speed", "adaptive")  # how the split layers are sized (inference.serve)


MODELS = ("hf-llama", "hf-mixtral")


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    model: str = field(default="hf-llama", metadata=_h(
        "hf-llama, hf-mixtral (built from a config: random weights) or a checkpoint "
        "directory (save_pretrained)"))
    n_layer: int = field(default=4, metadata=_h("decoder layers (a config model)"))
    n_embd: int = field(default=512, metadata=_h("hidden width (a config model)"))
    n_head: int = field(default=8, metadata=_h("query heads (a config model)"))
    n_kv_head: int = field(default=4, metadata=_h("key/value heads (a config model)"))
    vocab_size: int = field(default=1024, metadata=_h("vocabulary (a config model)"))
    max_positions: int = field(default=512, metadata=_h("positions (a config model)"))
    max_new_tokens: int = field(default=32, metadata=_h("tokens to decode after each prompt"))
    sample: bool = field(default=False, metadata=_h("sample instead of greedy"))
    temperature: float = field(default=1.0, metadata=_h("sampling temperature"))
    top_k: int | None = field(default=None, metadata=_h(
        "sample among the k most likely tokens (default: all)"))
    seed: int = field(default=0, metadata=_h("the weights' seed, and sampling's"))
    eos_id: int | None = field(default=None, metadata=_h(
        "end a row at this token id, padding it while the others go on (default: the "
        "model's generation config's eos_token_id, as transformers' generate)"))
    compile: bool = field(default=False, metadata=_h(
        "decode with a static KV cache and the step compiled (torch.compile, fullgraph); "
        "compiled before the clock starts, its seconds printed"))
    requests: str = field(default="batch", metadata=_h(
        "batch: every prompt in one batch; each: every prompt a request of its own, decoded "
        "in turn (serving)"))
    split: str = field(default="even", metadata=_h(
        "even: heads and MLP columns as parallelize makes them; speed: sized by each rank's "
        "speed measured before the first request; adaptive: speed, and sized again between "
        "requests where the speeds measured predict a gain of --tolerance or more"))
    tolerance: float = field(default=0.05, metadata=_h(
        "the least predicted gain (a share of the split layers' time) that moves the split "
        "between requests (--split adaptive)"))
    prompts: tuple[tuple[int, ...], ...] = field(default=((1, 2, 3, 4),), metadata={"help": None})
    extra: dict = field(default_factory=dict, metadata={"help": None})

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            folder = Path(self.model)
            if not folder.exists():
                raise ValueError(f"--model {self.model}: no such file or directory (a model "
                                 f"plait builds is one of {', '.join(MODELS)})")
            if not folder.is_dir():
                raise ValueError(f"--model {self.model}: a file, not a checkpoint directory "
                                 "(what save_pretrained writes)")
            if not (folder / "config.json").is_file():
                raise ValueError(f"--model {self.model}: no config.json in it (not a "
                                 "save_pretrained directory)")
        for name in ("n_layer", "n_embd", "n_head", "n_kv_head", "vocab_size",
                     "max_positions", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(self, name)}")
        if self.sample and not self.temperature > 0:
            raise ValueError(f"--temperature must be above 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be at least 1, got {self.top_k}")
        if self.eos_id is not None and self.eos_id < 0:
            raise ValueError(f"--eos-id must be a token id (0 or more), got {self.eos_id}")
        if not self.prompts or any(len(p) == 0 for p in self.prompts):
            raise ValueError("every prompt needs at least one token id")
        if self.requests not in ("batch", "each"):
            raise ValueError(f"--requests must be batch or each, got {self.requests!r}")
        if self.split not in SPLITS:
            raise ValueError(f"--split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"--tolerance must be in [0, 1), got {self.tolerance}")
        if self.model in MODELS and (self.n_head % self.n_kv_head or self.n_embd % self.n_head):
            raise ValueError(f"--n-head {self.n_head} must be a multiple of --n-kv-head "
                             f"{self.n_kv_head} and divide --n-embd {self.n_embd}")

    def check_slow(self, specs) -> None:
        """``--slow``'s request windows, against the requests this run makes: a slowdown
        that could never begin is refused, not ignored."""
        requests = len(self.prompts) if self.requests == "each" else 1
        for spec in specs:
            start = getattr(spec, "from_step", 0)
            if start >= requests:
                raise ValueError(
                    f"--slow {spec.rank}:{spec.factor:g}@{start}: this run makes {requests} "
                    f"request{'s' if requests != 1 else ''} (0 to {requests - 1}; "
                    "--requests each makes one a prompt)")
        once_per_rank(specs)

    def _check_heads(self, ranks: int) -> None:
        """Every rank needs a whole query head (KV heads are copied into sub-groups where
        the ranks outnumber them: :func:`plait.parallel.dims.head_split`)."""
        if self.model in MODELS:
            n_q, n_kv = self.n_head, self.n_kv_head
        else:
            text = self._config()
            n_q = getattr(text, "num_attention_heads", None)
            n_kv = getattr(text, "num_key_value_heads", None) or n_q
            if not n_q:
                return
        try:
            head_split(n_q, n_kv, ranks)
        except ValueError as err:
            raise ValueError(f"--ranks {ranks}: {err} (the model has {n_q} query heads over "
                             f"{n_kv} KV heads)") from None

    def _config(self):
        """A checkpoint's config (its text model's), read from config.json once."""
        return _text_config(self.model)

    def limits(self) -> tuple[int, int]:
        """(vocabulary, positions) of the model, read from the checkpoint's config.json."""
        if self.model in MODELS:
            return self.vocab_size, self.max_positions
        text = self._config()
        return text.vocab_size, getattr(text, "max_position_embeddings", 1 << 30)

    def check(self, ranks: int | None = None) -> None:
        """Refuse, in one line, what the model cannot decode, before any rank starts: its
        sizes against the prompts, its heads against ``ranks``, a checkpoint's weight files
        (missing, truncated, not the index's)."""
        if ranks is not None:
            self._check_heads(ranks)
        if self.model not in MODELS:
            from ..checkpoint.sources import CheckpointFileError, SafetensorsDir

            try:
                SafetensorsDir(self.model)
            except CheckpointFileError as err:  # named by the flag, the file by its name
                where = str(err).removeprefix(str(Path(self.model))).lstrip("/: ")
                raise ValueError(f"--model {self.model}: {where}") from None
        vocab, positions = self.limits()
        longest = max(len(p) for p in self.prompts)
        if longest + self.max_new_tokens > positions:
            raise ValueError(f"a {longest}-token prompt and --max-new-tokens "
                             f"{self.max_new_tokens} need {longest + self.max_new_tokens} "
                             f"positions; the model has {positions}")
        if self.eos_id is not None and self.eos_id >= vocab:
            raise ValueError(f"--eos-id {self.eos_id} is outside the vocabulary (0 to "
                             f"{vocab - 1})")
        bad = sorted({t for p in self.prompts for t in p if not 0 <= t < vocab})
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0 to "
                             f"{vocab - 1})")


@functools.lru_cache(maxsize=8)
def _text_config(model: str):
    """``model``'s config.json as transformers reads it (its text model's, for a multimodal
    one); a ValueError in one line where it cannot."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model {model}: {str(err).splitlines()[0]}") from None
    return config.get_text_config() if hasattr(config, "get_text_config") else config
