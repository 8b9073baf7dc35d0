"""What the operators' cross-rank check costs a decoding step, measured side by side.

    .venv/bin/python scripts/check_cost.py [--ranks 2] [--rounds 6] [--transport shm]

The Llama of ``plait bench decode`` (its defaults: 4 x 512, 8 heads, 4 KV heads, batch 1,
48 new tokens) decodes on ``--ranks`` ranks of this host, in two ways taking turns in
balanced rounds (ABBA…):

- ``header``: as plait runs: on shared memory each operator's check rides in the header
  of the call that carries its data (a ``gather_meta`` of its own only where no data call
  follows at once);
- ``gather``: every check made as it was before the shared-memory transport: one gloo
  all_gather of the operator's fields on the context's check group, before the call.

It prints the checks a step makes (counted), each way's median step over every round's
steps (slowest rank), and the difference: what the check costs a step when it is a call
of its own. A measurement, not a test: the figures go in reports/results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _body(rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    from plait.bench.decode import DecodeBenchConfig, _llama
    from plait.ops import context as ops_context
    from plait.ops.agree import start_gather_checked
    from plait.parallel import parallelize
    from plait.runtime.timing import agreed_max, balanced_round
    from plait.training.decode import decode
    from plait.transport import select

    torch.set_num_threads(1)
    cfg = DecodeBenchConfig()
    model = parallelize(_llama(cfg), "auto")
    prompt = torch.randint(0, cfg.vocab_size, (1, cfg.prompt_len),
                           generator=torch.Generator().manual_seed(cfg.seed + 1))
    header_meta = ops_context.OpsContext.start_meta
    header_mar = select.ShmTransport.matmul_all_reduce
    counts = {"separate": 0, "in_header": 0}
    counting = [False]

    def gathered(self, op, width, row, problem=None):  # the check as a gloo all_gather
        if counting[0]:
            counts["separate"] += 1
        group = self.group if self.checks_group is None else self.checks_group
        done = start_gather_checked(op, group, problem, row, width)
        return lambda: [tuple(r) for r in done()]

    def mar_gathered(self, x, w, region=None, check=None, transposed=False):
        if check is not None:
            ctx = ops_context.get_context(self.group)
            check[3](gathered(ctx, check[0], len(check[2]), check[2])())
        return header_mar(self, x, w, region=region, check=None, transposed=transposed)

    def counted_meta(self, *args, **kwargs):
        if counting[0]:
            counts["separate"] += 1
        return header_meta(self, *args, **kwargs)

    def counted_mar(self, x, w, region=None, check=None, transposed=False):
        if counting[0] and check is not None:
            counts["in_header"] += 1
        return header_mar(self, x, w, region=region, check=check, transposed=transposed)

    ways = {"header": (counted_meta, counted_mar), "gather": (gathered, mar_gathered)}

    def run(way: str, count: bool = False):
        ops_context.OpsContext.start_meta, select.ShmTransport.matmul_all_reduce = ways[way]
        counting[0] = count
        try:
            return decode(model, prompt, cfg.new_tokens)
        finally:
            counting[0] = False
            ops_context.OpsContext.start_meta = header_meta
            select.ShmTransport.matmul_all_reduce = header_mar

    run("header")
    run("gather")  # warm-up: first calls allocate, the operators decide
    one = run("header", count=True)
    steps_counted = len(one.step_s) + 1  # the prefill's forward too
    seen: dict[str, list[float]] = {"header": [], "gather": []}
    tokens = {}
    for i in range(rounds):
        for way in balanced_round(list(seen), i):
            out = run(way)
            seen[way] += agreed_max(out.step_s)
            tokens[way] = out.tokens
    medians = {way: statistics.median(s) * 1e3 for way, s in seen.items()}
    return {"transport": ops_context.transport_of(None).choice.name,
            "world_size": dist.get_world_size(),
            "checks_per_step_separate": counts["separate"] / steps_counted,
            "checks_per_step_in_header": counts["in_header"] / steps_counted,
            "ms_per_token": medians, "steps": {w: len(s) for w, s in seen.items()},
            "check_ms_per_token": medians["gather"] - medians["header"],
            "same_tokens": bool(tokens["header"].equal(tokens["gather"]))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--transport", default="shm", choices=("shm", "gloo", "auto"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from plait.runtime.launch import launch

    out = launch(_body, args.ranks, args=(args.rounds,), threads=1, timeout_s=60,
                 deadline_s=1800, env={"PLAIT_TRANSPORT": args.transport})[0]
    for way, ms in out["ms_per_token"].items():
        print(f"{way:>7}: {ms:6.3f} ms a token (median of {out['steps'][way]} steps)")
    print(f"checks a step: {out['checks_per_step_in_header']:.0f} in a data call's header, "
          f"{out['checks_per_step_separate']:.0f} as a call of their own; "
          f"the check as a gloo gather costs {out['check_ms_per_token']:.3f} ms a token; "
          f"same tokens: {out['same_tokens']} ({out['transport']}, {out['world_size']} ranks)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
