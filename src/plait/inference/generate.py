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

import functools

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..runtime.fields import help_meta as _h
from ..runtime.straggler import once_per_rank

__all__ = ["GenerateConfig", "MODELS", "build_model", "generate_rank", "read_prompts",
           "stopping", "text_prompts", "tokenizer_of"]

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
        from .serve import SPLITS

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
        from ..parallel.dims import head_split

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


def tokenizer_of(model: str):
    """The tokenizer saved beside a checkpoint directory's model, or None (a model plait
    builds from a config, or a checkpoint saved without one)."""
    if model in MODELS:
        return None
    folder = Path(model)
    if not any((folder / name).is_file() for name in
               ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model {model}: its tokenizer does not load: "
                         f"{str(err).splitlines()[0]}") from None


def text_prompts(texts, model: str, tokenizer) -> tuple[tuple[int, ...], ...]:
    """``--prompt``'s texts as token ids (its tokenizer's); refused in one line where the
    model has none."""
    if tokenizer is None:
        where = "a model built from a config" if model in MODELS else model
        raise ValueError(f"--prompt takes text, and {where} has no tokenizer (save one beside "
                         "the model with tokenizer.save_pretrained); give token ids with "
                         "--prompt-ids")
    rows = tuple(tuple(tokenizer(text)["input_ids"]) for text in texts)
    if any(not row for row in rows):
        raise ValueError("--prompt: a text that gives no tokens")
    return rows


def read_prompts(text: str | None, path: str | None) -> tuple[tuple[int, ...], ...]:
    """Prompts from ``--prompt-ids`` ("1 2 3") or ``--prompt-file`` (one prompt a line, ids
    by spaces or commas; or a JSON list of lists); a ValueError naming the line."""
    if text is not None and path is not None:
        raise ValueError("give --prompt-ids or --prompt-file, not both")
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"--prompt-file {path}: "
                             f"{'a folder' if file.is_dir() else 'no such file'}")
        raw = file.read_text()
        if raw.lstrip().startswith("["):
            try:
                rows = json.loads(raw)
                return tuple(tuple(int(t) for t in row) for row in rows)
            except (ValueError, TypeError) as err:
                raise ValueError(f"--prompt-file {path}: not a JSON list of lists of token "
                                 f"ids ({err})") from None
        lines = [ln for ln in raw.splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"--prompt-file {path}: no prompt in it")
        return tuple(_ids(ln, f"--prompt-file {path} line {i + 1}")
                     for i, ln in enumerate(lines))
    return (_ids(text if text is not None else "1 2 3 4", "--prompt-ids"),)


def _ids(line: str, where: str) -> tuple[int, ...]:
    parts = line.replace(",", " ").split()
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        bad = next(p for p in parts if not p.lstrip("-").isdigit())
        raise ValueError(f"{where}: {bad!r} is not a token id (prompts are token ids, "
                         "separated by spaces)") from None


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
            "gain": out.gain, "moved": out.moved})
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
