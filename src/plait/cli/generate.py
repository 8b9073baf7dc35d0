"""``plait generate``: decode prompts with a transformers causal LM on N ranks
(:mod:`plait.inference.generate`), printing the tokens and the per-token timings."""

from __future__ import annotations

import argparse
import json

from ..bench.report import console, print_table
from ..inference.config import MODELS, GenerateConfig
from ..inference.prompts import read_prompts, text_prompts, tokenizer_of
from ..runtime.placement import run_placed
from .args import add_dataclass_args, dataclass_from_args
from .common import add_launch_args, check_outputs, resolve_placement

__all__ = ["register", "run_generate"]


def register(parser, _rest=None) -> None:
    parser.description = ("Builds a transformers causal LM from a config (random weights, no "
                          "download) or loads a checkpoint directory (each rank its shards), "
                          "makes it tensor-parallel by its own plan and decodes the prompts "
                          "(text through the checkpoint's tokenizer, or token ids) with its KV "
                          "cache, each row ending at the model's EOS; prints the new tokens and"
                          " the per-token timings.")
    add_launch_args(parser)
    add_dataclass_args(parser, GenerateConfig)
    parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                        help="a prompt as text, tokenized by the checkpoint's own tokenizer; "
                             "the new tokens are printed as text too (repeatable: a batch)")
    parser.add_argument("--prompt-ids", default=None, metavar="IDS",
                        help='one prompt, token ids separated by spaces (default "1 2 3 4")')
    parser.add_argument("--prompt-file", default=None, metavar="PATH",
                        help="prompts, one a line (ids separated by spaces), or a JSON list "
                             "of lists: decoded together as a batch (--requests each: in turn)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="write the tokens and timings as JSON")
    parser.add_argument("--slow", action="append", default=[],
                        metavar="RANK:FACTOR[@FROM[-UNTIL]]",
                        help="make a rank FACTOR × slower at compute in the split layers "
                             "(straggler emulation) for requests FROM to UNTIL - 1 (default "
                             "all; a request's index is the straggler's step; repeatable, one "
                             "a rank)")
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(GenerateConfig, args)
    tokenizer = None
    if args.prompt is not None:
        if args.prompt_ids is not None or args.prompt_file is not None:
            raise ValueError("give --prompt (text), --prompt-ids or --prompt-file, one of them")
        tokenizer = tokenizer_of(cfg.model)
        prompts = text_prompts(args.prompt, cfg.model, tokenizer)
    else:
        prompts = read_prompts(args.prompt_ids, args.prompt_file)
    cfg = GenerateConfig(**{**cfg.__dict__, "prompts": prompts})
    ranks, hosts, link = resolve_placement(args)
    cfg.check(ranks)  # before any rank starts
    cfg.check_slow(getattr(args, "slow_specs", ()))
    args.plot = None
    check_outputs(args, "json")
    result, where = run_placed(_one, cfg, ranks=ranks, hosts=hosts, link=link,
                               timeout_s=args.timeout, slow=list(getattr(args, "slow_specs", ())))
    console.print(f"[dim]{where}; transport {result['transport']}[/dim]")
    if result.get("compile_s") is not None:
        console.print(f"[dim]compiled in {result['compile_s']:.1f} s, before the clock started"
                      "[/dim]")
    console.print(f"[dim]{(result['parallel'] or ['one rank'])[0]}[/dim]")
    eos = result.get("eos_token_id")
    stops = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    for i, tokens in enumerate(result["tokens"]):
        ended = next((k + 1 for k, t in enumerate(tokens) if t in stops), None)
        if ended is not None:  # said, not only padded
            result.setdefault("ended_at", {})[i] = ended
        if tokenizer is not None:  # text in, text out
            result.setdefault("texts", []).append(tokenizer.decode(tokens,
                                                                   skip_special_tokens=True))
            console.print(f"prompt {i}: {args.prompt[i]}", markup=False, soft_wrap=True)
            console.print(f"  → {result['texts'][-1]}", markup=False, soft_wrap=True)
            if ended is not None:
                console.print(f"  [dim](ended at its EOS after {ended} tokens)[/dim]")
            continue
        # one line each, however long: the terminal wraps it, not rich (a copy pastes whole)
        console.print(f"prompt {i}: {' '.join(map(str, prompts[i]))}", markup=False,
                      soft_wrap=True)
        console.print(f"  → {' '.join(map(str, tokens[:ended]))}", markup=False, soft_wrap=True)
        if ended is not None:
            console.print(f"  [dim](ended at its EOS after {ended} tokens)[/dim]")
    if cfg.requests == "each" or cfg.split != "even":
        print_table(f"requests in turn, split {cfg.split}",
                    ["request", "ms / token", "TTFT (ms)", "split", "speeds after",
                     "predicted gain", "moved"],
                    [[str(i), f"{r['ms_per_token']:.2f}", f"{r['ttft_ms']:.1f}",
                      " ".join(f"{d} {s}" for d, s in r["split"].items()),
                      " ".join(f"{v:.2f}" for v in r["speeds"]) if r["speeds"] else "–",
                      "–" if r["gain"] is None else f"{r['gain']:.1%}",
                      ("yes" if r["moved"] else "–" if r["gain"] is None else "no")
                      + (f"; experts of {r['placed']} layers placed" if r.get("placed") else "")]
                     for i, r in enumerate(result["requests"])],
                    caption="split: each split dim's shares (KV-head groups, MLP columns) the "
                            "request ran on; speeds after: what its first steps measured; "
                            f"moved: the split was sized again before the next request (where "
                            f"the predicted gain is --tolerance {cfg.tolerance:.0%} or more); "
                            "experts placed: an MoE's experts moved by the tokens routed to "
                            "them and the speeds, hot ones copied; "
                            "–: nothing decided (the last request, or --split even/speed)")
    count = len(prompts)
    print_table(f"up to {cfg.max_new_tokens} tokens × {count} prompt{'s' if count != 1 else ''} on "
                f"{ranks} rank{'s' if ranks != 1 else ''}",
                ["TTFT (ms)", "ms / token", "p99 (ms)", "tokens/s"],
                [[f"{result['ttft_ms']:.1f}", f"{result['ms_per_token']:.2f}",
                  f"{result['p99_ms']:.2f}", f"{result['tokens_per_s']:,.0f}"]],
                caption="a step: the slowest rank's; ms / token: the median step after the "
                        "first token")
    if args.json:
        with open(args.json, "w") as f:
            where_ran = {"ranks": ranks, "hosts": hosts, "link": link, "slow": list(args.slow)}
            built = cfg.model in MODELS  # a checkpoint's sizes are its own, not these flags
            sizes = ("n_layer", "n_embd", "n_head", "n_kv_head", "vocab_size", "max_positions")
            json.dump({"config": {**{k: v for k, v in cfg.__dict__.items() if k != "extra"
                                     and (built or k not in sizes)}, **where_ran}, **result},
                      f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


def _one(cfg: GenerateConfig) -> list:
    from ..inference.generate import generate_rank  # torch: on the ranks

    return generate_rank(cfg)
