"""``plait bench load``: each rank's peak resident memory while it builds a transformers model on
the meta device and reads only its shards (``plait.from_pretrained``), against the model's
full size, and its loss against one process that loads the model whole.

The checkpoint is made first, in a process of its own (so no rank inherits it): a
transformers Llama of at least ``size_gb`` GB of float32 weights (width 2048, 16 query heads
over 4 KV heads, layers added until the size is reached), saved with ``save_pretrained`` as
safetensors files of at most ``max_shard_mb``. Then, each in fresh processes: one process
loads it whole (``LlamaForCausalLM.from_pretrained``: the reference loss and its memory),
and for each world size the ranks call ``plait.from_pretrained``; 4 KV-head groups over 3
ranks are [2, 1, 1], uneven. Memory is the kernel's count of the process's resident pages
(``VmHWM``, peak, and ``VmRSS``, from ``/proc/self/status``): the rank's own tensors, the
interpreter and libraries (``baseline``, read before loading), and the pages of the
checkpoint tensor being read while its file is mapped. Both peaks are read after the load
and one forward: transformers' whole load maps the files and reads a page only when the
forward touches it, so a peak read right after loading would leave the weights out. The
bound the issue set: peak ≤ 0.6 × the model's bytes + 0.5 GB.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .config.load import LoadBenchConfig

__all__ = ["LoadBenchConfig", "bench_load", "BOUND"]

BOUND = (0.6, 0.5e9)  # peak ≤ 0.6 × model bytes + 0.5 GB


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))


def _make(path: str, fields: dict, max_shard_mb: int) -> dict:
    """Build the Llama (seed 0) and save it; its bytes and files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields))
    model.save_pretrained(path, max_shard_size=f"{max_shard_mb}MB")
    files = sorted(p.name for p in Path(path).glob("*.safetensors"))
    return {"model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "files": len(files)}


def _whole(path: str) -> dict:
    """One process, transformers' own loader, the whole model: the reference."""
    from transformers import LlamaForCausalLM

    baseline = _status()["VmRSS"]
    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(path)
    load_s = time.perf_counter() - start
    with torch.no_grad():
        loss = float(model(input_ids=_batch(model.config.vocab_size),
                           labels=_batch(model.config.vocab_size)).loss)
    peak = _status()["VmHWM"]  # after a forward: the mapped files' pages it read count
    return {"peak_rss": peak, "baseline_rss": baseline, "load_s": load_s, "loss": loss}


def _rank(path: str) -> dict:
    """plait.from_pretrained on this rank: its memory, its share, the loss."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401  (imported, not timed)

    import plait

    baseline = _status()["VmRSS"]
    start = time.perf_counter()
    model = plait.from_pretrained(path)
    load_s = time.perf_counter() - start
    own = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    vocab = model.config.vocab_size
    with torch.no_grad():
        loss = float(model(input_ids=_batch(vocab), labels=_batch(vocab)).loss)
    peak = _status()["VmHWM"]  # through the load and one forward, as the whole load's
    heads = list(model.model.layers[0].self_attn.q_proj.plan.sizes)
    return {"rank": dist.get_rank(), "peak_rss": peak, "baseline_rss": baseline,
            "own_bytes": own, "load_s": load_s, "loss": loss, "kv_groups": heads}


def bench_load(cfg: LoadBenchConfig, *, timeout_s: float | None = None,
               on_stage=None) -> tuple[list[dict], dict]:
    """Make the checkpoint, load it whole once and on each world size; the records (one per
    rank, and the whole load's) and a summary."""
    from ..runtime import launch

    say = on_stage or (lambda text: None)
    folder = Path(cfg.dir) if cfg.dir else Path(tempfile.mkdtemp(prefix="plait-load-"))
    fields = cfg.llama()
    try:
        say(f"saving a Llama of {fields['num_hidden_layers']} layers to {folder}")
        made = launch(_make, 1, args=(str(folder), fields, cfg.max_shard_mb),
                      timeout_s=timeout_s, threads=1)[0]
        say("loading it whole in one process")
        whole = launch(_whole, 1, args=(str(folder),), timeout_s=timeout_s, threads=1)[0]
        records = [{"system": "whole", "world": 1, **whole}]
        for world in cfg.worlds:
            say(f"loading it on {world} ranks")
            for rank in launch(_rank, world, args=(str(folder),), timeout_s=timeout_s,
                               threads=1):
                records.append({"system": "plait", "world": world, **rank})
    finally:
        if cfg.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    full = made["model_bytes"]
    bound = BOUND[0] * full + BOUND[1]
    for r in records:
        r["model_bytes"] = full
        r["bound_rss"] = bound
        r["within_bound"] = r["peak_rss"] <= bound
        r["loss_diff"] = abs(r["loss"] - whole["loss"])
    plait_rows = [r for r in records if r["system"] == "plait"]
    summary = {"config": asdict(cfg), "model": fields, "model_bytes": full,
               "files": made["files"], "bound_rss": bound,
               "max_peak_rss": max(r["peak_rss"] for r in plait_rows),
               "all_within_bound": all(r["within_bound"] for r in plait_rows),
               "max_loss_diff": max(r["loss_diff"] for r in plait_rows),
               "whole_peak_rss": whole["peak_rss"]}
    return records, summary
