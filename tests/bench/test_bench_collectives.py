"""plait bench collectives: nccl-tests' definitions, correct results, clear errors."""

import json

import pytest

from plait.bench.collectives import (COLLECTIVES, CollectiveBenchConfig, bench_collectives,
                                     bus_factor, sweep_sizes, uneven_splits)
from plait.cli.main import main
from plait.runtime import parse_rate

from conftest import needs_netns


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    for name in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven"):
        assert bus_factor(name, 4) == pytest.approx(0.75)


def test_sweep_sizes():
    cfg = CollectiveBenchConfig(min_bytes=1024, max_bytes=16384, step_factor=2)
    assert sweep_sizes(cfg) == [1024, 2048, 4096, 8192, 16384]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_uneven_splits_are_consistent(world):
    splits = uneven_splits(world, 1000)
    assert all(sum(row) == 1000 for row in splits)
    assert all(len(set(row)) > 1 for row in splits)  # every rank sends unequal amounts


@pytest.mark.parametrize("world", [2, 4])
def test_sweep_records_are_complete_and_correct(world):
    cfg = CollectiveBenchConfig(min_bytes=4096, max_bytes=65536, step_factor=16, warmup=1,
                                min_iters=2, max_iters=3, budget_s=0.01)
    records, where = bench_collectives(cfg, ranks=world, hosts=0)
    assert "loopback" in where
    assert len(records) == len(COLLECTIVES) * 2
    for r in records:
        assert r["wrong"] == 0
        assert r["world_size"] == world and r["link"] == "loopback"
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["collective"], world))
        assert r["link_share"] is None  # loopback: no link to fill
        # the largest message alone is also timed as pieces in flight
        if r["bytes"] == cfg.max_bytes:
            assert r["pieces"] == cfg.pieces and r["pieces_time_s"] > 0, r
            assert r["pieces_link_share"] is None, r
        else:
            assert (r["pieces"], r["pieces_time_s"], r["pieces_link_share"]) == (0, None, None), r


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    code = main(["bench", "collectives", "--ranks", "2", "--collectives", "all_reduce,all_to_all_uneven",
                 "--min-bytes", "4096", "--max-bytes", "8192", "--max-iters", "3", "--no-progress",
                 "--transport", "shm,gloo", "--json", str(out), "--plot", str(tmp_path / "bw.png")])
    assert code == 0
    data = json.loads(out.read_text())
    keys = {"collective", "bytes", "time_s", "time_us", "algbw_GBps", "busbw_GBps", "world_size",
            "link", "transport", "copy_GBps", "busbw_over_copy"}
    assert data["records"] and all(keys <= set(r) for r in data["records"])
    # both transports at every point, each correct
    assert sorted((r["collective"], r["bytes"], r["transport"]) for r in data["records"]) == \
        sorted((c, b, t) for c in ("all_reduce", "all_to_all_uneven") for b in (4096, 8192)
               for t in ("shm", "gloo"))
    assert not any(r["wrong"] for r in data["records"])
    assert data["meta"]["shortfalls"] == {}  # loopback: no link to fall short of
    assert (tmp_path / "bw.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "at least 1"),
    (["--hosts", "2", "--link", "1gbps"], "unknown link rate"),
    (["--hosts", "100000"], "more than this machine can make"),
    (["--ranks", "3", "--hosts", "2"], "does not divide"),
    (["--collectives", "all_sum"], "unknown collectives"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(["bench", "collectives", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cluster_run_slow_naming_missing_rank(capsys):
    assert main(["cluster", "run", "--ranks", "2", "--slow", "5:2", "--", "true"]) == 2
    assert "rank 5, but there are only 2 ranks" in capsys.readouterr().err


@needs_netns
def test_cluster_run_runs_a_torchrun_style_script(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from plait.runtime import init_from_env, rank_context\n"
        "topo = init_from_env()\n"
        "x = torch.ones(1); dist.all_reduce(x)\n"
        "assert x.item() == topo.world_size\n"
        "assert rank_context().straggler.factor() == (2.0 if topo.rank == 1 else 1.0)\n"
        "open(f'{__file__}.{topo.rank}', 'w').write(rank_context().link)\n")
    import sys
    code = main(["cluster", "run", "--hosts", "2", "--link", "1gbit", "--slow", "1:2",
                 "--", sys.executable, str(script)])
    assert code == 0
    assert [(tmp_path / f"job.py.{r}").read_text() for r in range(2)] == ["1gbit", "1gbit"]


@needs_netns
def test_sweep_on_an_emulated_cluster_is_held_to_its_link():
    link = "50mbit"  # 6.25 MB/s: loopback here moves 256 KiB several times faster
    cfg = CollectiveBenchConfig(min_bytes=4096, max_bytes=1 << 18, step_factor=64, warmup=1,
                                min_iters=2, max_iters=3, budget_s=0.01,
                                collectives=("all_reduce", "all_to_all_uneven"))
    records, where = bench_collectives(cfg, ranks=3, hosts=3, link=link)
    assert where.startswith("emulated cluster: 3 hosts") and link in where
    assert len(records) == 2 * 2
    for r in records:
        assert r["wrong"] == 0 and r["world_size"] == 3, r
        assert r["hosts"] == 3 and r["link"] == link, r
    # tbf lets 64 KiB pass at once (runtime.cluster._tbf), a quarter of the largest message:
    # up to 4/3 of the rate, and 1.5 × bounds it
    for r in records:
        if r["bytes"] > 1 << 17:
            assert r["busbw_GBps"] <= 1.5 * parse_rate(link) / 8 / 1e9, r
        # busbw (GB/s, 1e9 bytes) over the rate in bytes/s
        assert r["link_share"] == pytest.approx(r["busbw_GBps"] * 1e9 / (parse_rate(link) / 8)), r
