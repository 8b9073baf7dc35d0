"""``plait bench ops`` on a small sweep: every operator, 2 ranks on loopback, the records the
issue asks for, every timed variant's output checked against the plain path's.

Each operator has one shape that ``chunks="auto"`` fuses (conftest saves the uncalibrated
default profile in PLAIT_PROFILE, so auto's choice is the pieces model's on fixed figures:
the same on any machine) and a tiny one that falls back (a 64-row matmul_all_reduce, a
4-row GEMV); every shape is also timed at a fixed 2 pieces, which fuses.
"""

import pytest

from plait.bench.ops import OpsBenchConfig, bench_ops, summarize
from plait.runtime.timing import median

# op → (shape, what auto takes there: (path, pieces))
SHAPES = {
    "matmul_all_reduce": [(dict(m=64, k=32, n=48), ("fallback", 1)),
                          (dict(m=4, k=32, n=256), ("fallback", 1)),  # GEMV: pieces cut N
                          (dict(m=256, k=512, n=256), ("fused", 3))],
    "all_gather_matmul": [(dict(m=256, k=256, n=1024), ("fused", 2))],
    "matmul_reduce_scatter": [(dict(m=256, k=256, n=256), ("fused", 2))],
    "embedding_all_to_all": [(dict(tables=2, rows=1000, dim=64, batch=1024, pool=16),
                              ("fused", 3))],
    "all_to_all_matmul": [(dict(tokens=512, hidden=128, experts=2, ffn=128), ("fused", 2))],
    "matmul_all_to_all": [(dict(tokens=512, hidden=128, experts=2, ffn=128), ("fused", 2))],
}
SWEEP = {op: [shape for shape, _ in cases] for op, cases in SHAPES.items()}
AUTO = [taken for cases in SHAPES.values() for _, taken in cases]
KEYS = {"op", "shape", "t_compute_s", "t_comm_s", "t_unfused_s", "t_fused_s", "t_limit_s",
        "t_beside_s", "chunks", "path", "correct", "correct_by_variant", "path_by_variant",
        "max_abs_diff_by_variant", "t_fixed_s", "peak_bytes_fused", "t_rounds_s",
        "auto_over_best_fixed", "auto_choice_over_best_fixed", "auto_over_own_count"}


@pytest.fixture(scope="module")
def records():
    cfg = OpsBenchConfig(sweep=SWEEP, iters=2, warmup=0, fixed_chunks=(1, 2))
    out, _, calibration = bench_ops(cfg, ranks=2, hosts=0, link=None, timeout_s=60)
    assert set(calibration) == {"profile", "memory_Bps", "curves", "gemm"}
    return out


def test_every_operator_has_its_record_and_every_timed_variant_is_correct(records):
    assert [(r["op"], r["shape"]) for r in records] == [(op, s) for op, ss in SWEEP.items() for s in ss]
    for r in records:
        assert KEYS <= set(r), KEYS - set(r)
        # every variant timed, but the two halves alone: the plain path, beside, auto, each count
        checked = {"unfused", "beside", *r["t_rounds_s"]}
        assert set(r["correct_by_variant"]) == checked, r["correct_by_variant"]
        assert all(r["correct_by_variant"].values()), (r["op"], r["max_abs_diff_by_variant"])
        assert r["correct"] and r["max_abs_diff"] == max(r["max_abs_diff_by_variant"].values())
        assert min(r["t_beside_s"], r["t_unfused_s"], r["t_compute_s"], r["t_comm_s"]) > 0


def test_auto_and_each_count_take_the_path_asked_for(records):
    """One shape per operator fuses under auto, at the pieces the model picks; every count
    of 2 or more fuses with as many pieces (the fixed counts' outputs were checked above)."""
    for r, (path, chunks) in zip(records, AUTO):
        assert (r["path"], r["chunks"]) == (path, chunks), (r["op"], r["shape"], r["reason"])
        assert r["path_by_variant"]["auto"] == [path, chunks]
        assert set(r["path_by_variant"]) == set(r["t_rounds_s"]) == {"auto", "1", "2", str(chunks)}
        for count, taken in r["path_by_variant"].items():
            if count != "auto":
                assert taken == (["fused", int(count)] if count != "1" else ["fallback", 1])
        if path == "fallback":
            assert "pieces would be under" in r["reason"], r["reason"]
    assert {r["op"] for r in records if r["path"] == "fused"} == set(SHAPES)


def test_the_figures_are_what_the_timings_imply(records):
    for r in records:
        rounds, own = r["t_rounds_s"], str(r["chunks"])
        assert all(len(ts) == 2 and min(ts) > 0 for ts in rounds.values())
        assert r["t_fused_s"] == median(rounds["auto"])
        assert r["t_fixed_s"] == {c: median(rounds[c]) for c in ("1", "2")}  # auto's own: beside
        best = min(r["t_fixed_s"], key=r["t_fixed_s"].get)
        assert (r["best_fixed_chunks"], r["t_best_fixed_s"]) == (int(best), r["t_fixed_s"][best])
        assert r["t_limit_s"] == max(r["t_compute_s"], r["t_comm_s"])
        exact = pytest.approx  # the same quotients, computed again
        assert r["speedup"] == exact(r["t_unfused_s"] / r["t_fused_s"])
        assert r["efficiency"] == exact(r["t_limit_s"] / r["t_fused_s"])
        assert r["efficiency_vs_beside"] == exact(r["t_beside_s"] / r["t_fused_s"])
        assert r["comm_ratio"] == exact(r["t_comm_s"] / r["t_compute_s"])

        def paired(a, b):  # round by round, then the median
            return median([x / y for x, y in zip(rounds[a], rounds[b])])
        assert r["auto_over_best_fixed"] == exact(paired("auto", best))
        assert r["auto_choice_over_best_fixed"] == exact(paired(own, best))
        assert r["auto_over_own_count"] == exact(paired("auto", own))


def test_the_summary_reads_the_records(records):
    summary = summarize(records)
    assert summary["all_correct"] is True
    assert summary["balanced_shapes"] == sum(0.5 <= r["comm_ratio"] <= 2 for r in records)
    assert summary["worst_auto_over_unfused"] == max(r["t_fused_s"] / r["t_unfused_s"]
                                                     for r in records)
    assert summary["worst_auto_choice_over_best_fixed"] == max(
        r["auto_choice_over_best_fixed"] for r in records)
