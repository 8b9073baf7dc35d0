"""The discrete-event cluster simulator: scale, fusion, balancing."""

import numpy as np
import pytest

from plait.perf.config import SimConfig
from plait.perf.simulator import Engine, rank_speeds, simulate
from plait.perf.workload import Pair, build_workload, group_layout


def _cfg(**kw) -> SimConfig:
    base = {"cluster": "h100-64", "model": "llama3-8b", "parallel": {"tp": 8, "dp": 8, "fsdp": True},
            "steps": 3}
    base.update(kw)
    return SimConfig.from_dict(base)


def test_16k_gpus_simulate():
    """16,384 GPUs, every variant. How long it takes is the benchmark's figure, not this
    test's: ``plait simulate`` prints it ("simulated in … s") and writes it to its JSON
    (``wall_s``; docs/results/simulate-h100-16k)."""
    cfg = SimConfig.from_dict({
        "cluster": {"preset": "h100-16k", "speeds": {"mixed": {"A100": 0.1}, "transient_prob": 0.01,
                                                     "jitter": 0.02}},
        "model": "llama3-70b", "parallel": {"tp": 8, "dp": 2048, "fsdp": True}, "steps": 4})
    assert cfg.cluster.num_gpus == 16384
    res = simulate(cfg)  # 2 fusion settings x 5 policies
    assert res.wall_s > 0  # measured and handed back, for the command to print
    assert len(res.variants) == 10
    assert all(v.step_s > 0 and 0 <= v.exposed_comm_share <= 1 for v in res.variants)
    for policy in cfg.policies:  # at this scale too, fusion hides communication
        assert res.get(fused=True, policy=policy).step_s < res.get(fused=False, policy=policy).step_s
    # the transient slowdowns hold back the even split; semi-migration recovers part of it
    assert res.get(fused=False, policy="semi").step_s < res.get(fused=False, policy="even").step_s


def test_shares_add_up_and_fusion_hides_tensor_parallel_communication():
    res = simulate(_cfg(), policies=("even",))
    unf, fus = res.get(fused=False), res.get(fused=True)
    for v in (unf, fus):
        assert v.compute_share + v.wait_share + v.exposed_comm_share == pytest.approx(1.0, abs=1e-6)
    assert fus.step_s < unf.step_s
    assert fus.exposed_comm_share < unf.exposed_comm_share
    assert unf.wait_share == pytest.approx(0.0, abs=1e-9)  # identical GPUs never wait for peers


def test_a_slow_rank_sets_the_pace_and_balancing_recovers_it():
    cfg = _cfg(cluster={"preset": "h100-64", "speeds": {"jitter": 0.15}}, steps=4)
    res = simulate(cfg, fusion=(False,))
    even, migrate, static = (res.get(fused=False, policy=p) for p in ("even", "migrate", "static"))
    assert even.wait_share > 0.05
    assert migrate.step_s < even.step_s  # measures the jitter and moves shards
    assert static.step_s == pytest.approx(even.step_s)  # jitter is not a known GPU generation
    assert res.get(fused=False, policy="resize").skipped > 0


def test_generations_mixed_inside_tp_groups_are_balanced_by_static_shards():
    cfg = _cfg(cluster={"preset": "h100-64", "speeds": {"mixed": {"A100": 0.125}, "mixed_per": "gpu"}})
    res = simulate(cfg, fusion=(False,), policies=("even", "static", "resize"))
    even, static = res.get(fused=False, policy="even"), res.get(fused=False, policy="static")
    assert static.step_s < 0.7 * even.step_s and static.wait_share < even.wait_share
    assert res.get(fused=False, policy="resize").step_s < even.step_s


def test_transient_spikes_favour_resize_and_semi_over_even():
    cfg = _cfg(cluster={"preset": "h100-64", "speeds": {"transient_prob": 0.05, "transient_steps": 3,
                                                        "transient_slowdown": 0.5}}, steps=6, seed=3)
    res = simulate(cfg, fusion=(False,))
    even = res.get(fused=False, policy="even").step_s
    assert res.get(fused=False, policy="resize").step_s < even
    assert res.get(fused=False, policy="semi").step_s < even


def test_moe_and_dlrm_workloads_run_and_fuse():
    moe = SimConfig.from_dict({"cluster": "h100-64", "model": "mixtral-8x7b", "steps": 2,
                               "parallel": {"tp": 4, "ep": 8, "dp": 2}})
    w = build_workload(moe)
    assert any(isinstance(op, Pair) and op.axis == "ep" for op in w.fwd)
    r = simulate(moe, policies=("even",))
    assert r.get(fused=True).step_s <= r.get(fused=False).step_s
    dlrm = SimConfig.from_dict({"cluster": {"preset": "mi300x-128n", "nodes": 4}, "model": "dlrm",
                                "steps": 2, "parallel": {"tp": 1, "dp": 32}})
    r = simulate(dlrm, policies=("even",))
    assert r.get(fused=True).step_s < r.get(fused=False).step_s


def test_group_layout_and_engine_barrier():
    cfg = _cfg()
    assert group_layout("tp", cfg) == (8, 1)
    assert group_layout("dp", cfg) == (1, 8)
    eng = Engine((1, 1, 4))
    eng.compute(np.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 4))
    eng.blocking("tp", 0.5)
    assert np.allclose(eng.t, 4.5) and np.allclose(eng.wait.ravel(), [3, 2, 1, 0])


def test_mixed_generations_are_assigned_per_node():
    cfg = _cfg(cluster={"preset": "h100-64", "speeds": {"mixed": {"A100": 0.25}}})
    nominal, _ = rank_speeds(cfg, np.random.default_rng(0))
    per_node = nominal.reshape(8, 8)
    assert np.all(per_node.min(1) == per_node.max(1))  # one generation per node
    assert (per_node[:, 0] < 1).sum() == 2  # a quarter of 8 nodes


def test_the_cli_says_why_every_policy_reads_the_same(capsys):
    """On a cluster whose ranks all run at one speed no policy moves work: simulate says so
    under its table; where speeds differ (h100-flaky: transient slowdowns) it does not."""
    from plait.cli.main import main

    said = "every policy gives the same step"
    assert main(["simulate", "--cluster", "dgx-h100", "--model", "gpt-small"]) == 0
    assert said in capsys.readouterr().out
    assert main(["simulate", "--cluster", "h100-flaky", "--model", "gpt-small"]) == 0
    assert said not in capsys.readouterr().out
