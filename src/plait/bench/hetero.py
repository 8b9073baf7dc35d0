"""``plait bench hetero``: tensor parallelism with a slow rank, under each balancing policy.

Every rank trains the same small GPT (plait TP, fused operators) from the same seed on the
same batches, once per (seed, scenario, policy), all in one launch, each run through the
training loop (:class:`plait.bench.balanced_run.BalancedRun`). A seed's runs are
interleaved step by step in balanced orders (each run in each place and after each other
run equally often, :func:`plait.runtime.timing.balanced_round`), every step started
together, so load on a shared machine that drifts lands on every policy of the seed alike.

The scenarios (:mod:`plait.runtime.slow.scenarios`) slow ranks by sleeping (``--slow-by sleep``,
``(F − 1)`` × each compute piece, on top of any host CPU budget) or by the kernel
(``--slow-by kernel``: one rank per host, and before every step each host's cgroup CPU
quota is set to its budget ÷ ``F``, so the slow host is slow at everything it runs; each
record then carries, per rank and step, the budget the kernel held, the CPU share and the
throttled periods). ``noisy-neighbour`` puts a real busy loop on the last rank's host,
resumed only for its own run's steps.

Per run: every step's time (the slowest rank's: forward, backward, update and the
balancer's own step, migrations included), the losses, the balancer's decisions, the
held-out loss and accuracy, and the ratio to the ideal step
(:mod:`plait.bench.hetero_ideal`); the summary and the plot: :mod:`plait.bench.hetero_summary`.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace

import torch
import torch.distributed as dist

from ..balance import PolicyConfig
from ..ops.agree import gather_checked
from ..ops.context import attempt
from ..runtime import rank_context
from ..runtime.slow.cgroup import NoisyNeighbour, cpu_budget
from ..runtime.slow.straggler import host_throttle
from ..runtime.timing import balanced_round
from ..training.data import CharCorpus
from .balanced_run import BalancedRun
from .config.hetero import QUICK_HETERO, HeteroBenchConfig
from .hetero_ideal import with_ideal
from ..runtime.slow.scenarios import Neighbour, factors_at, scenario_specs

__all__ = ["HeteroBenchConfig", "QUICK_HETERO", "run_hetero", "bench_hetero"]


def run_hetero(cfg: HeteroBenchConfig) -> list[dict]:
    """What each rank runs: every (seed, scenario, policy); rank 0's records are the result.

    A seed's runs are interleaved step by step, in the balanced orders of
    :func:`plait.runtime.timing.balanced_round` (each run in each place and after each
    other run equally often), every step started together: load on a shared machine that
    drifts lands on every policy of the seed alike, and the ratio to that seed's ``none``
    run compares runs that saw the same machine."""
    world = dist.get_world_size()
    torch.set_num_threads(1)
    corpus = CharCorpus.load()
    report = rank_context().report
    runs = cfg.runs()
    noisy = None
    setup, problem = attempt(lambda: _host_setup(cfg, world))
    throttle, neighbour = setup or (None, None)
    try:
        # a host without what its runs need stops every rank, not only its own
        gather_checked("bench hetero", None, problem, [], 0)
        if neighbour is not None:  # started now, held until its run's steps
            noisy = NoisyNeighbour(rank_context().host.cgroup).start()
            noisy.pause()
        return _run_seeds(cfg, world, corpus, report, runs, throttle, noisy)
    finally:
        if noisy is not None:
            noisy.stop()
        if throttle is not None:
            throttle(1.0)  # the host's whole budget again


def _host_setup(cfg: HeteroBenchConfig, world: int):
    """This rank's kernel throttle (``--slow-by kernel``, else None) and whether a
    noisy-neighbour run puts a neighbour on its host; refused where its host lacks a CPU
    budget that either needs."""
    throttle = _kernel_throttle() if cfg.slow_by == "kernel" else None
    rank = dist.get_rank()
    mine = [s for sc in cfg.scenario_names() for s in scenario_specs(sc, world, cfg)
            if isinstance(s, Neighbour) and s.rank == rank]
    if cfg.neighbour and rank_context().host.cgroup is None:
        raise ValueError("the noisy-neighbour scenario needs hosts with a CPU budget (--hosts N"
                         " --host-cpu CORES, one rank per host): the neighbour takes its "
                         f"host's cores; rank {rank}'s host has none")
    return throttle, (mine[0] if mine else None)


def _kernel_throttle():
    """This rank's host's throttle for ``--slow-by kernel``: its cgroup, its full budget read
    back from the kernel."""
    host = rank_context().host
    if host.cgroup is None:
        raise ValueError("--slow-by kernel needs hosts with a CPU budget (--hosts N "
                         "--host-cpu CORES, one rank per host); this rank's host has none")
    budget = cpu_budget(host.cgroup)
    if budget is None:
        raise ValueError(f"--slow-by kernel: host {host.index}'s cgroup {host.cgroup} has no "
                         "CPU limit to scale")
    return host_throttle(host.cgroup, budget)


def _run_seeds(cfg: HeteroBenchConfig, world: int, corpus, report, runs, throttle,
               noisy) -> list[dict]:
    out, done = [], 0
    for seed in sorted({s for s, _, _ in runs}):
        mine = [(sc, pol) for s, sc, pol in runs if s == seed]
        live = []
        for scenario, policy in mine:
            specs = scenario_specs(scenario, world, cfg)
            policy_cfg = PolicyConfig(name=policy, spike_steps=cfg.spike_steps,
                                      confirm_steps=cfg.confirm_steps)
            live.append((scenario, policy, specs,
                         BalancedRun(cfg.train_config(seed), policy_cfg, specs, corpus,
                                     every=cfg.every, refresh=cfg.refresh, throttle=throttle,
                                     noisy=noisy, accounting=cfg.neighbour)))
        for step in range(cfg.steps):
            for *_, run in balanced_round(live, step):
                run.step(step)
        if throttle is not None:
            throttle(1.0)  # evaluation (not timed) on the whole budget
        for scenario, policy, specs, run in live:
            out.append(_record(cfg, seed, scenario, policy, specs, run.finish(), world))
            done += 1
            if dist.get_rank() == 0:
                report({"run": done, "of": len(runs), "scenario": scenario, "policy": policy,
                        "seed": seed, "t_step_s": out[-1]["t_step_s"]})
    return with_ideal(out, cfg.warmup)


def _record(cfg: HeteroBenchConfig, seed: int, scenario: str, policy: str, specs, result: dict,
            world: int) -> dict:
    times = result.pop("times")
    timed = times[cfg.warmup:]
    return {"seed": seed, "scenario": scenario, "policy": policy, "world_size": world,
            "t_step_s": statistics.median(timed), "step_times_s": times,
            "losses": result["losses"], "heldout_loss": result["eval"]["heldout_loss"],
            "heldout_acc": result["eval"]["heldout_accuracy"],
            "compute_s_per_step": result["compute_s_per_step"],
            "cpu_s_per_step": statistics.fmean(result["cpu_s_steps"][cfg.warmup:]),
            "speeds": result["speeds"],
            # how the factors were made: a neighbour's are its own, nothing slept or throttled
            "slow_by": "neighbour" if scenario == "noisy-neighbour" else cfg.slow_by,
            "kernel": result.get("kernel"),
            "monitor_overhead": result["monitor_s"] / max(sum(times), 1e-12),
            "decisions": result["decisions"], "final_state": result["final_state"],
            "factors": [factors_at(specs, world, s) for s in range(cfg.steps)],
            "link": cfg.extra.get("link", "loopback"), "hosts": cfg.extra.get("hosts", 0),
            "host_cpu": cfg.extra.get("host_cpu"),
            "scenario_file": (cfg.scenario.to_json() if cfg.scenario is not None
                              and scenario == cfg.scenario.name else None),
            "model": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                      "seq_len": cfg.seq_len, "batch_size": cfg.batch_size},
            "overlap": cfg.overlap, "interleaved": True}


def bench_hetero(cfg: HeteroBenchConfig, *, ranks: int, hosts: int = 0,
                 link: str | None = "1gbit", timeout_s: float | None = None,
                 on_progress=None,
                 host_cpu: float | list[float] | None = None) -> tuple[list[dict], str]:
    """Every run on ``ranks`` ranks over ``hosts`` emulated hosts (0: loopback); ``host_cpu``
    as in :func:`plait.runtime.placement.run_placed`. ``--slow-by kernel`` needs one rank per
    host, and gives each host 1 core where no budget is given; so does the noisy-neighbour
    scenario (a neighbour on a host with two ranks would slow both)."""
    from ..runtime.placement import HOST_CPU_ENV, run_placed

    cfg = replace(cfg)
    cfg.check_world(ranks)
    if cfg.check_placement(ranks, hosts) and host_cpu is None \
            and not os.environ.get(HOST_CPU_ENV):
        host_cpu = 1.0
    records, where = run_placed(run_hetero, cfg, ranks=ranks, hosts=hosts, link=link,
                                timeout_s=timeout_s, on_progress=on_progress, host_cpu=host_cpu)
    if cfg.slow_by == "kernel":  # the budget above is the whole; a slowed host gets less
        where += "; --slow-by kernel: a host F × slower is held to its budget ÷ F each step"
    return records, where
