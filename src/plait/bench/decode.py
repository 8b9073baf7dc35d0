"""``plait bench decode``: tensor-parallel decoding of a transformers Llama, per-token latency
against one process and against PyTorch's tensor parallelism.

Every rank builds the same Llama from one seed (``--n-layer`` × ``--n-embd``, ``--n-head``
query heads over ``--n-kv-head`` KV heads) and makes copies parallel with the model's own
plan, each a *system*:

- ``plait``: ``plait.parallelize(model, "auto")``, fused operators with ``chunks="auto"``
  (which at a few rows picks the plain path where pieces cannot pay; ``explain`` says);
- ``plait-plain``: the same with ``overlap=False``;
- ``pytorch-tp``: ``parallelize_module`` with the same plan in PyTorch's styles
  (DTensor: the KV heads must divide over the ranks);
- ``one-process``: the whole model on rank 0, the other ranks waiting, on as many threads
  as the ranks use cores (``threads`` in its records: 2 on 2 ranks of a thread each; on
  emulated hosts, what rank 0's host can run): the process a user would run instead;
- ``one-process-compiled`` and ``plait-compiled`` (``--compile``): the same decoding with a
  static KV cache and the step compiled (``torch.compile``, ``fullgraph=True``), as users
  who decode run it; compiled before the clock starts;
- ``plait-gather-checks`` (asked for with ``--systems``): ``plait`` with every cross-rank
  check a gloo all_gather of its own before its data call (``PLAIT_CHECKS=gather``), as
  before the shared-memory transport carried them in its headers: what that saves a step.

For each batch size, each system decodes ``--new-tokens`` tokens greedily after a
``--prompt-len`` prompt (``plait.inference.decode``: one forward a token, KV cache), every
system in turn and in balanced orders for ``--rounds`` rounds. A step takes as long as its
slowest rank. Per system and batch: the median per-token latency over every round's
steps (``ms_per_token``), its 99th percentile, the time to first token (median over
rounds), tokens/s (batch ÷ per-token latency), and whether its tokens equal
``one-process``'s (``same_tokens``). Which transport carried the bytes (``auto``: shared
memory on one host) is in every record.
"""

from __future__ import annotations

import copy
import statistics
import torch
import torch.distributed as dist

from ..inference.decode import decode, step_figures
from ..inference.split import split_sizes
from ..runtime import rank_context
from ..runtime.slow.straggler import once_per_rank
from ..runtime.timing import agreed_max, balanced_round
from .config.decode import ALONE, COMPILED, SYSTEMS, DecodeBenchConfig

__all__ = ["DecodeBenchConfig", "SYSTEMS", "bench_decode", "check_slow", "kernel_budgets",
           "run_decode_bench", "summarize"]


def check_slow(specs) -> None:
    """``--slow`` for bench decode: a slowdown lasts the whole run (a decode has no steps
    or requests to count a window in), each rank named once; refused, not ignored."""
    for spec in specs:
        if spec.from_step or spec.until_step is not None:
            raise ValueError(f"--slow {spec.rank}:{spec.factor:g}@…: bench decode slows a "
                             "rank for the whole run (no @FROM-UNTIL; generate --requests "
                             "each takes request windows)")
    once_per_rank(specs)


def _llama(cfg: DecodeBenchConfig):
    from types import SimpleNamespace

    from ..inference.generate import build_model

    return build_model(SimpleNamespace(model="hf-llama", vocab_size=cfg.vocab_size,
                                       n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                                       n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                                       max_positions=cfg.prompt_len + cfg.new_tokens + 8,
                                       seed=cfg.seed))


def _systems(cfg: DecodeBenchConfig, ref) -> dict:
    """Each system's model on this rank (None where it cannot run here), and why not."""
    from ..parallel import parallelize
    from .tp_hf import own_plan, torch_tp_plan

    world = dist.get_world_size()
    out, why = {}, {}
    for name in cfg.systems:
        if name in ALONE:
            out[name] = ref if name == "one-process" else copy.deepcopy(ref)
        elif name == "pytorch-tp":
            if cfg.n_kv_head % world:
                why[name] = f"DTensor splits {cfg.n_kv_head} KV heads evenly only: not over {world}"
                continue
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import parallelize_module

            mesh = init_device_mesh("cpu", (world,))
            model = copy.deepcopy(ref)
            out[name] = parallelize_module(model, mesh, torch_tp_plan(own_plan(model, "auto")))
        else:
            out[name] = parallelize(copy.deepcopy(ref), "auto", overlap=name != "plait-plain")
    return out, why


def baseline_threads() -> int:
    """The threads one process gets to stand against the ranks: every core they use (a
    thread a rank), no more than rank 0 can run on: its CPUs, and its emulated host's CPU
    budget where it has one."""
    import math
    import os

    cores = dist.get_world_size() * torch.get_num_threads()
    cores = min(cores, len(os.sched_getaffinity(0)))
    from ..runtime.slow.cgroup import cpu_budget

    host = getattr(rank_context(), "host", None)
    budget = cpu_budget(host.cgroup) if host is not None and host.cgroup else None
    if budget:
        cores = min(cores, max(1, math.ceil(budget)))
    return cores


def _checks(system: str) -> str:
    return "gather" if system == "plait-gather-checks" else "carried"


def _speed_split(cfg: DecodeBenchConfig, model, prompt, speeds=None) -> dict:
    """plait-speed: every split dim sized by the speeds measured on this batch's ``prompt``
    (``speeds``: measured already, on the even split; else measured here). A rank's speed
    depends on the batch: at batch 1 a layer's call costs about the same however few
    columns it holds, so speeds measured there understate a slow host's slowness at 64."""
    from ..inference.split import measure_speeds, split_by_speed

    if speeds is None:
        speeds, _, _ = measure_speeds(model, prompt, cfg.speed_steps)
    return {"speeds": list(speeds), "sizes": {d: list(s) for d, s in
                                                split_by_speed(model, speeds).items()}}


def _timed(model, prompt, cfg: DecodeBenchConfig, system: str, threads: int = 1,
           cache_len: int | None = None):
    """One decode of ``system`` on every rank (one process: rank 0 alone on ``threads``
    threads, the others wait): tokens, the prefill's and every step's seconds (this
    rank's). How the operators check across ranks meanwhile (``OpsContext.checks``):
    ``plait-gather-checks``'s gather, else carried."""
    from ..ops import get_context

    alone = system in ALONE
    if alone and dist.get_rank() != 0:
        dist.barrier()
        return None, 0.0, [0.0] * (cfg.new_tokens - 1)
    ctx = None if alone else get_context()
    saved = None if ctx is None else ctx.checks
    if ctx is not None:
        ctx.checks = _checks(system)
    own = torch.get_num_threads()
    torch.set_num_threads(threads if alone else own)
    try:
        out = decode(model, prompt, cfg.new_tokens, compiled=system in COMPILED, eos_token_id=None,
                     cache_len=cache_len or prompt.shape[1] + cfg.new_tokens)
    finally:
        torch.set_num_threads(own)
        if ctx is not None:
            ctx.checks = saved
    if alone:
        dist.barrier()
    return out.tokens, out.ttft_s, out.step_s


def run_decode_bench(cfg: DecodeBenchConfig) -> list[dict]:
    """On every rank: every system, batch size and round; the records (rank 0's are whole)."""
    from ..ops import explain
    from ..ops.context import transport_of

    torch.set_num_threads(1)
    world = dist.get_world_size()
    threads = baseline_threads()
    ref = _llama(cfg)
    models, why = _systems(cfg, ref)
    transport = transport_of(None).choice
    names = list(models)
    records = []
    for batch in cfg.batch_sizes:
        prompt = torch.randint(0, cfg.vocab_size, (batch, cfg.prompt_len),
                               generator=torch.Generator().manual_seed(cfg.seed + batch))
        # the even split's speeds on this batch; the split by them, before the warm-up
        capacity = _capacity(cfg, models, prompt) if "plait" in models else None
        split = None if "plait-speed" not in models else _speed_split(
            cfg, models["plait-speed"], prompt, None if capacity is None else capacity["speeds"])
        for name in names:  # warm-up: first calls allocate, the operators decide, the
            # compiled systems compile (the same batch and cache length as the timed runs)
            _timed(models[name], prompt[:, :4], DecodeBenchConfig(**{**_fields(cfg),
                                                                     "new_tokens": 2}),
                   name, threads, cache_len=prompt.shape[1] + cfg.new_tokens)
        seen = {name: {"steps": [], "ttft": [], "tokens": None} for name in names}
        for i in range(cfg.rounds):
            for name in balanced_round(names, i):
                tokens, ttft, steps = _timed(models[name], prompt, cfg, name, threads)
                agreed = agreed_max([ttft, *steps])
                seen[name]["ttft"].append(agreed[0])
                seen[name]["steps"] += agreed[1:]
                seen[name]["tokens"] = tokens if tokens is not None else seen[name]["tokens"]
            rank_context().report({"batch": batch, "round": i + 1, "of": cfg.rounds})
        reference = seen.get("one-process", {}).get("tokens")
        for name in names:
            figures = step_figures(seen[name]["steps"], batch)
            ms, steps = figures["ms_per_token"], seen[name]["steps"]
            tokens = seen[name]["tokens"]
            records.append({
                "system": name, "batch": batch, "world_size": world,
                "ranks_used": 1 if name in ALONE else world,
                "threads": threads if name in ALONE else world * torch.get_num_threads(),
                "compiled": name in COMPILED, **figures,
                "ttft_ms": statistics.median(seen[name]["ttft"]) * 1e3,
                "same_tokens": None if reference is None or tokens is None
                else bool(torch.equal(tokens, reference)),
                "transport": "–" if name in ALONE else dist.get_backend()
                if name == "pytorch-tp" else transport.name,
                "transport_reason": "one rank: nothing to communicate" if name in ALONE else
                "DTensor: the process group's backend" if name == "pytorch-tp" else
                transport.reason, "steps": len(steps),
                "new_tokens": cfg.new_tokens, "link": rank_context().link, **cfg.extra})
            if name == "plait-speed" and split is not None:
                records[-1]["split"] = split
            elif name.startswith("plait"):
                records[-1]["split"] = {"sizes": {d: list(v) for d, v in
                                                  split_sizes(models[name]).items()}}
            if name in ("plait", "plait-speed") and capacity is not None:
                even = statistics.median(sorted(seen["plait"]["steps"]))
                records[-1].update(_ideal(capacity, even, ms / 1e3))
    for name, reason in why.items():
        records.append({"system": name, "skipped": reason, "world_size": world})
    if records:
        records[0]["paths"] = explain()
    return records


def _capacity(cfg: DecodeBenchConfig, models: dict, prompt) -> dict:
    """Each rank's compute and work per token in the split layers, the even split's, on this
    batch's prompt (a short decode with the layers timed)."""
    from ..inference.split import measure_speeds

    speeds, compute, work = measure_speeds(models["plait"], prompt, cfg.speed_steps)
    return {"speeds": list(speeds), "compute_s": compute, "work": work}


def _ideal(capacity: dict, even_step_s: float, step_s: float) -> dict:
    """The capacity ideal (:func:`plait.inference.split.decode_ideal`) from the even split's
    median step and its ranks' compute and work per token."""
    from ..inference.split import decode_ideal

    ideal = decode_ideal(even_step_s, capacity["compute_s"], capacity["work"])
    return {"ideal_ms": ideal * 1e3, "ratio_to_ideal": step_s / ideal,
            "rank_speeds": capacity["speeds"], "rank_compute_ms": [c * 1e3 for c in
                                                                    capacity["compute_s"]]}


def _fields(cfg: DecodeBenchConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def summarize(records: list[dict]) -> dict:
    """Per batch: each system's ms/token over one-process's and over pytorch-tp's."""
    out = {}
    by = {(r["system"], r["batch"]): r for r in records if "batch" in r}
    for (system, batch), r in by.items():
        one, torch_tp = by.get(("one-process", batch)), by.get(("pytorch-tp", batch))
        if one is not None and system != "one-process":
            out[f"{system}_b{batch}_vs_one_process"] = r["ms_per_token"] / one["ms_per_token"]
        compiled = by.get(("one-process-compiled", batch))
        if compiled is not None and system == "plait-compiled":
            out[f"{system}_b{batch}_vs_one_process_compiled"] = \
                r["ms_per_token"] / compiled["ms_per_token"]
        eager = by.get(("plait", batch))
        if eager is not None and system == "plait-compiled":
            out[f"{system}_b{batch}_vs_plait"] = r["ms_per_token"] / eager["ms_per_token"]
        if torch_tp is not None and system.startswith("plait"):
            out[f"{system}_b{batch}_vs_pytorch_tp"] = r["ms_per_token"] / torch_tp["ms_per_token"]
        even = by.get(("plait", batch))
        if system == "plait-speed" and even is not None:
            out[f"plait-speed_b{batch}_vs_plait"] = r["ms_per_token"] / even["ms_per_token"]
        if system == "plait-gather-checks" and even is not None:  # what carrying saves
            out[f"plait_b{batch}_check_saving_ms"] = r["ms_per_token"] - even["ms_per_token"]
        if "ratio_to_ideal" in r:
            out[f"{system}_b{batch}_ratio_to_ideal"] = r["ratio_to_ideal"]
    out["all_same_tokens"] = all(r["same_tokens"] in (True, None) for r in by.values())
    slower = [f"{system} is {r['ms_per_token'] / base['ms_per_token']:.2f} × {name}'s time a "
              f"token at batch {batch}" for (system, batch), r in by.items()
              if system.startswith("plait") for name in ALONE
              if (base := by.get((name, batch))) is not None
              and r["ms_per_token"] > base["ms_per_token"]]
    if slower:  # where plait loses to the process a user would run instead, said in words
        out["slower_than_one_process"] = slower
    return out


def bench_decode(cfg: DecodeBenchConfig, *, ranks: int, hosts: int = 0, link=None,
                 timeout_s: float | None = None, on_progress=None,
                 slow=()) -> tuple[list[dict], str]:
    """:func:`run_decode_bench` on ``ranks`` ranks (``hosts`` emulated hosts, 0: loopback).
    ``slow``: ``SlowSpec``s; with ``cfg.slow_by == "kernel"`` each becomes its host's CPU
    budget ÷ its factor for the whole run (the kernel holds the rank back, compute and
    communication alike), else the launcher's sleep-made slowdown of the split layers."""
    from ..runtime.placement import run_placed

    host_cpu = None
    if cfg.slow_by == "kernel":
        host_cpu, slow = kernel_budgets(ranks, hosts, slow), ()
    records, where = run_placed(run_decode_bench, cfg, ranks=ranks, hosts=hosts, link=link,
                                timeout_s=timeout_s, on_progress=on_progress, slow=slow,
                                host_cpu=host_cpu)
    if host_cpu is not None:
        where += f"; --slow-by kernel: host CPU budgets {host_cpu} cores"
    return records, where


def kernel_budgets(ranks: int, hosts: int, slow) -> list[float]:
    """Every host's CPU budget in cores for ``--slow-by kernel``: the full budget
    (``--host-cpu``, default 1 core a host) with each slowed rank's host's divided by its
    factor. Refused unless every rank has its own host and every slowdown lasts the run."""
    import os

    from ..runtime.slow.cgroup import MIN_BUDGET, parse_budgets, parse_host_cpu
    from ..runtime.placement import HOST_CPU_ENV

    if not hosts or hosts != ranks:
        raise ValueError(f"--slow-by kernel needs one rank per host (--hosts {ranks} with "
                         f"--ranks {ranks}): a host's CPU budget slows every rank on it")
    full = os.environ.get(HOST_CPU_ENV)
    budgets = parse_budgets(parse_host_cpu(full) if full else 1.0, hosts)
    for spec in slow:
        if spec.from_step or spec.until_step is not None:
            raise ValueError(f"--slow {spec.rank}:{spec.factor:g}@…: with --slow-by kernel a "
                             "slowdown lasts the whole run (no @FROM-UNTIL)")
        budgets[spec.rank] /= spec.factor
        if budgets[spec.rank] < MIN_BUDGET:
            raise ValueError(f"--slow {spec.rank}:{spec.factor:g} leaves host {spec.rank} "
                             f"{budgets[spec.rank]:g} core, under {MIN_BUDGET:g}")
    return budgets
