"""``plait bench ops`` on a tiny sweep: every operator, 2 ranks on loopback, the records the
issue asks for, each fused result checked against the plain one."""

import pytest

from plait.bench.ops import OpsBenchConfig, bench_ops, summarize

TINY = {
    "matmul_all_reduce": [dict(m=64, k=32, n=48), dict(m=4, k=32, n=256)],
    "all_gather_matmul": [dict(m=64, k=32, n=48)],
    "matmul_reduce_scatter": [dict(m=64, k=32, n=48)],
    "embedding_all_to_all": [dict(tables=2, rows=100, dim=8, batch=32, pool=3)],
    "all_to_all_matmul": [dict(tokens=64, hidden=16, experts=2, ffn=8)],
    "matmul_all_to_all": [dict(tokens=64, hidden=16, experts=2, ffn=8)],
}
KEYS = {"op", "shape", "t_compute_s", "t_comm_s", "t_unfused_s", "t_fused_s", "t_limit_s",
        "t_beside_s", "chunks", "path", "correct", "t_fixed_s", "peak_bytes_fused", "t_rounds_s",
        "auto_over_best_fixed", "auto_choice_over_best_fixed", "auto_over_own_count"}


@pytest.fixture(scope="module")
def records():
    cfg = OpsBenchConfig(sweep=TINY, iters=2, warmup=0, fixed_chunks=(1, 2))
    out, _, calibration = bench_ops(cfg, ranks=2, hosts=0, link=None, timeout_s=60)
    assert set(calibration) == {"profile", "memory_Bps", "curves", "gemm"}
    return out


def test_every_operator_has_its_record_and_is_correct(records):
    assert [r["op"] for r in records] == [op for op, shapes in TINY.items() for _ in shapes]
    for r in records:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["correct"], r
        assert r["t_limit_s"] == max(r["t_compute_s"], r["t_comm_s"])
        assert min(r["t_beside_s"], r["t_fused_s"], r["t_unfused_s"]) > 0
        assert set(r["t_fixed_s"]) == {"1", "2"}
        assert set(r["t_rounds_s"]) == {"auto", "1", "2"}  # every round of auto and each count
        assert all(len(ts) == 2 and min(ts) > 0 for ts in r["t_rounds_s"].values())
        assert r["auto_over_best_fixed"] > 0


def test_autos_own_count_is_timed_beside_the_sweeps():
    """Auto's choice is compared as a fixed count (the same code), timed beside the sweep's
    counts but not among them: the best fixed count is still the sweep's."""
    cfg = OpsBenchConfig(sweep={"matmul_all_reduce": [dict(m=64, k=32, n=48)]}, iters=3,
                         warmup=0, fixed_chunks=(2,))
    (r,), _, _ = bench_ops(cfg, ranks=2, hosts=0, link=None, timeout_s=60)
    assert (r["path"], r["chunks"]) == ("fallback", 1)  # 64 rows: too few bytes to cut
    assert set(r["t_rounds_s"]) == {"auto", "1", "2"} and set(r["t_fixed_s"]) == {"2"}
    assert r["best_fixed_chunks"] == 2
    ones, twos = r["t_rounds_s"]["1"], r["t_rounds_s"]["2"]
    assert r["auto_choice_over_best_fixed"] == sorted(a / b for a, b in zip(ones, twos))[1]
    assert r["auto_over_own_count"] > 0


def test_the_summary_reads_the_records(records):
    summary = summarize(records)
    assert summary["all_correct"] is True
    assert summary["balanced_shapes"] == sum(0.5 <= r["comm_ratio"] <= 2 for r in records)
