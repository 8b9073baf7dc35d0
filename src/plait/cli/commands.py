"""The commands as tables, each command's module imported only when it is the one named.

A command's flags come from its config dataclass, which lives beside the code that runs it
(torch and all); building every command's parser for ``plait --help`` took 2.5 s here.
So ``plait --help`` lists the names and lines below and imports nothing, and
``plait train …`` imports the train command's module alone.
"""

from __future__ import annotations

import importlib

__all__ = ["COMMANDS", "BENCHMARKS", "add_commands"]

# name → (the module that fills its parser in, its line in the parent's --help)
COMMANDS = {
    "demo": (".demo", "train a GPT while one rank turns slow: plain TP against plait"),
    "bench": (".bench", "benchmarks: collectives, fused operators, …"),
    "cluster": (".cluster", "emulated cluster: run a command on it, clean up"),
    "simulate": (".simulate", "performance model and cluster simulator"),
    "train": (".train", "train a small GPT, MoE-GPT, DLRM, or transformers Llama or Mixtral "
                        "with plait's parallel layers"),
    "generate": (".generate", "decode prompts with a transformers model, tensor-parallel"),
    "elastic": (".elastic", "train under torchrun's elastic agents on emulated hosts and "
                            "survive losing one"),
}

BENCHMARKS = {
    "collectives": (".bench_collectives",
                    "nccl-tests-style sweep of torch.distributed collectives"),
    "ops": (".bench_ops", "fused operators against compute-then-collective"),
    "tp": (".bench_tp", "plait's tensor parallelism against PyTorch's (DTensor) on a GPT or "
                        "a transformers Llama"),
    "hetero": (".bench_hetero",
               "a slow rank under each balancing policy (even, static, resize, migrate, semi)"),
    "checkpoint": (".bench_checkpoint",
                   "how long training waits for a checkpoint, blocking against asynchronous"),
    "load": (".bench_load", "peak memory per rank while loading a checkpoint shard by shard, "
                            "against the model's size"),
    "decode": (".bench_decode", "per-token latency of tensor-parallel decoding, against one "
                                "process and PyTorch TP"),
    "experts": (".bench_experts", "MoE experts placed by routed load and rank speed, hot ones "
                                  "replicated, against even blocks"),
}


def add_commands(subparsers, table: dict, words: list[str] | None) -> None:
    """One parser per command of ``table``, its ``--help`` line given; the flags of the one
    ``words`` names (its first word that is not a flag) filled in by its module's
    ``register(parser, rest)``, ``rest`` being the words after its name. ``words`` None
    fills in every command (a test walking them all)."""
    chosen = None if words is None else next((w for w in words if not w.startswith("-")), None)
    for name, (module, help_text) in table.items():
        parser = subparsers.add_parser(name, help=help_text)
        if words is not None and name != chosen:
            continue  # named in --help; its module loads when it is the command
        rest = None if words is None else words[words.index(name) + 1:]
        importlib.import_module(module, __package__).register(parser, rest)
