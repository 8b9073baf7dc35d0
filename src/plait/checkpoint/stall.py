"""How long training waits for a checkpoint, blocking vs asynchronous.

    python -m plait.checkpoint.stall [--ranks 2] [--checkpoints 5] [--every 3]

The GPT of ``plait bench tp`` (2 blocks, 8 heads, width 512, 128 tokens × 16 sequences,
fused, 2 micro-batches; AdamW) trains on ``--ranks`` ranks (gloo, loopback). First
``2 × every`` steps without checkpoints give the plain step time (median). Then, for
each mode, ``checkpoints`` checkpoints, one every ``every`` steps, each timed as

- *stall*: the ``Checkpointer.save`` call, during which training waits (blocking: the
  whole write, fsync and publication; asynchronous: waiting for the previous save, the
  CPU copy of the tensors and the start of DCP's writing thread);
- *interval extra*: the stall plus the ``every`` steps after it, minus as many plain
  steps: also counts the background write's slowdown of those steps (on a shared,
  loaded machine the step-to-step spread swamps it, and it comes out negative).

Each figure is the median over the checkpoints; every checkpoint's is printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

__all__ = ["measure_stall", "main"]


def _rank_stall(root: str, checkpoints: int, every: int) -> dict:
    import torch
    import torch.distributed as dist

    from ..bench.tp import TPBenchConfig
    from ..train import build_gpt
    from .checkpointer import Checkpointer

    cfg = TPBenchConfig()
    model = build_gpt(cfg.train_config(overlap=True), vocab_size=97)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)

    def step() -> float:
        x = torch.randint(0, 97, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        model(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    for _ in range(2):
        step()  # warm-up
    plain = statistics.median(step() for _ in range(2 * every))
    out = {"plain_step_s": plain}
    for mode in ("blocking", "async"):
        ckpt = Checkpointer(f"{root}/{mode}", keep=2)
        calls, extras = [], []
        for n in range(checkpoints):
            dist.barrier()
            start = time.perf_counter()
            ckpt.save(n, model, opt, {"step": n}, blocking=mode == "blocking")
            calls.append(time.perf_counter() - start)
            steps = [step() for _ in range(every)]
            extras.append(calls[-1] + sum(steps) - every * plain)
        ckpt.wait()
        out[mode] = {"stall_s": calls, "interval_extra_s": extras}
    return out


def measure_stall(ranks: int = 2, checkpoints: int = 5, every: int = 3) -> dict:
    """Rank 0's figures (see the module docstring); seconds."""
    from ..runtime.launch import launch

    root = tempfile.mkdtemp(prefix="plait-stall-")
    try:
        result = launch(_rank_stall, ranks, args=(root, checkpoints, every), timeout_s=300)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for mode in ("blocking", "async"):
        for key in ("stall_s", "interval_extra_s"):
            result[mode][f"median_{key}"] = statistics.median(result[mode][key])
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m plait.checkpoint.stall",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--checkpoints", type=int, default=5)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    result = measure_stall(args.ranks, args.checkpoints, args.every)
    print(f"plain step: {result['plain_step_s'] * 1e3:.1f} ms (median)")
    for mode in ("blocking", "async"):
        r = result[mode]
        stalls = ", ".join(f"{c * 1e3:.0f}" for c in r["stall_s"])
        extras = ", ".join(f"{s * 1e3:.0f}" for s in r["interval_extra_s"])
        print(f"{mode:>8}: stall {r['median_stall_s'] * 1e3:.1f} ms median [{stalls}]; "
              f"interval extra {r['median_interval_extra_s'] * 1e3:.1f} ms median [{extras}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
