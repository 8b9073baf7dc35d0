"""``plait bench ops`` on a small sweep: every operator, 2 ranks on loopback, the records the
issue asks for, every timed variant's output checked against the plain path's.

Each operator has one shape that ``chunks="auto"`` fuses (conftest saves the uncalibrated
default profile in PLAIT_PROFILE, so auto's choice is the pieces model's on fixed figures:
the same on any machine) and a tiny one that falls back (a 64-row matmul_all_reduce, a
4-row GEMV); every shape is also timed at a fixed 2 pieces, which fuses.
"""

import pytest

from plait.bench.case import busiest_link_bytes
from plait.bench.cases_sparse import _routing
from plait.bench.ops import OpsBenchConfig, beats_limit, bench_ops, physical_limit, summarize
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
        "t_unfused_one_call_s", "t_unfused_pieces_s", "unfused_pieces", "limit_kind", "t_link_s",
        "limit_tolerance_s", "link_bytes", "rank_link_bytes", "beats_limit", "speedup_one_call",
        "t_beside_s", "chunks", "path", "correct", "correct_by_variant", "path_by_variant",
        "max_abs_diff_by_variant", "t_fixed_s", "peak_bytes_fused", "t_rounds_s",
        "t_measured_rounds_s", "t_compute_fastest_s", "t_comm_fastest_s",
        "auto_over_best_fixed", "auto_choice_over_best_fixed", "auto_over_own_count",
        "auto_over_unfused"}


@pytest.fixture(scope="module")
def records():
    cfg = OpsBenchConfig(sweep=SWEEP, iters=2, warmup=0, fixed_chunks=(1, 2), min_time_s=0)
    out, _, calibration = bench_ops(cfg, ranks=2, hosts=0, link=None, timeout_s=60)
    assert set(calibration) == {"profile", "memory_Bps", "curves", "gemm"}
    return out


def test_every_operator_has_its_record_and_every_timed_variant_is_correct(records):
    assert [(r["op"], r["shape"]) for r in records] == [(op, s) for op, ss in SWEEP.items() for s in ss]
    for r in records:
        assert KEYS <= set(r), KEYS - set(r)
        # every variant timed, but the two halves alone: the plain path in one call and in
        # pieces, beside, auto, each count
        checked = {"unfused", "unfused_pieces", "beside", *r["t_rounds_s"]}
        assert set(r["correct_by_variant"]) == checked, r["correct_by_variant"]
        assert all(r["correct_by_variant"].values()), (r["op"], r["max_abs_diff_by_variant"])
        assert r["correct"] and r["max_abs_diff"] == max(r["max_abs_diff_by_variant"].values())
        assert min(r["t_beside_s"], r["t_unfused_one_call_s"], r["t_unfused_pieces_s"],
                   r["t_compute_s"], r["t_comm_s"]) > 0
        # the pieces the fused operator sends; where auto takes one, the sweep's most (2)
        assert r["unfused_pieces"] == (r["chunks"] if r["chunks"] > 1 else 2)


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
        # loopback: no rate, so the limit is the measured one, and no link is crossed
        assert (r["limit_kind"], r["t_link_s"], r["limit_tolerance_s"]) == ("measured", None, 0)
        # a lower bound: each measured term's fastest round, not its median
        fastest = {k: min(r["t_measured_rounds_s"][k]) for k in ("compute", "comm")}
        assert (r["t_compute_fastest_s"], r["t_comm_fastest_s"]) == (fastest["compute"], fastest["comm"])
        assert r["t_compute_fastest_s"] <= r["t_compute_s"]
        assert r["t_limit_s"] == max(r["t_compute_fastest_s"], r["t_comm_fastest_s"])
        assert r["link_bytes"] == 0
        assert r["beats_limit"] == (r["t_fused_s"] < r["t_limit_s"])
        assert r["t_unfused_s"] == min(r["t_unfused_one_call_s"], r["t_unfused_pieces_s"])
        exact = pytest.approx  # the same quotients, computed again
        assert r["speedup"] == exact(r["t_unfused_s"] / r["t_fused_s"])
        assert r["speedup_one_call"] == exact(r["t_unfused_one_call_s"] / r["t_fused_s"])
        assert r["efficiency"] == exact(r["t_limit_s"] / r["t_fused_s"])
        assert r["efficiency_vs_beside"] == exact(r["t_beside_s"] / r["t_fused_s"])
        assert r["comm_ratio"] == exact(r["t_comm_s"] / r["t_compute_s"])

        def paired(a, b):  # round by round, then the median
            return median([x / y for x, y in zip(rounds[a], rounds[b])])
        assert r["auto_over_best_fixed"] == exact(paired("auto", best))
        assert r["auto_choice_over_best_fixed"] == exact(paired(own, best))
        assert r["auto_over_own_count"] == exact(paired("auto", own))
        # auto against the unfused baseline (the one with the smaller median), round by round
        measured = r["t_measured_rounds_s"]
        base = min(("unfused", "unfused_pieces"), key=lambda k: median(measured[k]))
        assert r["t_unfused_s"] == median(measured[base])
        assert r["auto_over_unfused"] == exact(
            median([a / b for a, b in zip(rounds["auto"], measured[base])]))


def test_the_summary_reads_the_records(records):
    summary = summarize(records)
    assert summary["all_correct"] is True
    assert summary["balanced_shapes"] == sum(0.5 <= r["comm_ratio"] <= 2 for r in records)
    assert summary["worst_auto_over_unfused"] == max(r["auto_over_unfused"] for r in records)
    assert summary["worst_auto_over_unfused_medians"] == max(r["t_fused_s"] / r["t_unfused_s"]
                                                             for r in records)
    assert summary["auto_slower_than_unfused_by_5pct"] == [
        f"{r['op']} {r['shape']}" for r in records if r["auto_over_unfused"] > 1.05]
    assert summary["worst_auto_choice_over_best_fixed"] == max(
        r["auto_choice_over_best_fixed"] for r in records)
    assert summary["median_efficiency"] == median(r["efficiency"] for r in records)


def test_a_summary_prints_an_empty_list_as_none():
    """A fresh-eyes trial read ``beats_limit ,`` in a two-transport summary: an empty list
    printed as nothing."""
    from plait.bench.report import summary_text

    assert summary_text({"shm": {"beats_limit": [], "all_correct": True}}) == \
        "shm beats_limit none, all_correct True"
    assert summary_text([[], [0.5]], ".2f") == "[none], [0.50]"


def _sent_by_rank_0(op, shape):
    """Bytes rank 0 sends rank 1 and rank 1 sends rank 0 (2 ranks, float32), from the shape."""
    if op == "matmul_reduce_scatter":
        block = shape["m"] // 2 * shape["n"] * 4  # the other rank's rows of the partial sums
        return block, block
    if op == "embedding_all_to_all":
        block = shape["tables"] * shape["batch"] // 2 * shape["dim"] * 4
        return block, block
    rows = _routing(2, shape["experts"], shape["tokens"]).sum(2)  # [s][d] tokens
    out, back = int(rows[0][1]) * shape["hidden"] * 4, int(rows[1][0]) * shape["hidden"] * 4
    return (out, back) if op == "all_to_all_matmul" else (back, out)


def test_each_operator_s_link_bytes_follow_from_its_shape(records):
    """Were each rank a host: the busiest direction of the one link, in bytes."""
    for r in records:
        op, shape = r["op"], r["shape"]
        if op == "matmul_all_reduce":  # ring: 2(W-1)/W of the output, each way
            expected = 2 * (2 - 1) / 2 * shape["m"] * shape["n"] * 4
        elif op == "all_gather_matmul":  # the other rank's rows of x
            expected = shape["m"] // 2 * shape["k"] * 4
        else:
            expected = max(_sent_by_rank_0(op, shape))
        assert r["rank_link_bytes"] == expected, (op, shape)


def test_busiest_link_counts_only_bytes_between_hosts():
    sent = [[0, 5, 7], [2, 0, 11], [3, 13, 0]]  # [s][d] bytes
    # ranks 0 and 1 on host 0: host 0 sends 7 + 11 (and receives 3 + 13)
    assert busiest_link_bytes(sent, [0, 0, 1]) == 18
    assert busiest_link_bytes([[0, 5, 7], [2, 0, 11], [3, 17, 0]], [0, 0, 1]) == 20  # receives
    assert busiest_link_bytes(sent, [0, 1, 2]) == 5 + 13  # rank 1 receives the most
    assert busiest_link_bytes(sent, [0, 0, 0]) == 0  # one host: no link


def test_a_fused_time_under_the_physical_limit_is_rejected():
    """No processes: a synthetic record. 8 MiB over a 1 Gbit/s link take 67 ms; the token
    bucket lets 1 ms of line rate through at once (docs/link.md), so a fused time down to
    66 ms is possible, and 40 ms (the 1.72 "efficiency" of issue 21's table) is a bug."""
    limit = physical_limit(t_compute=0.010, t_comm=0.140, link_bytes=8 * 2**20, link="1gbit")
    assert limit["limit_kind"] == "link"
    assert limit["t_link_s"] == pytest.approx(8 * 2**20 * 8 / 1e9)
    assert limit["t_limit_s"] == limit["t_link_s"]  # not the measured 140 ms collective
    assert limit["limit_tolerance_s"] == pytest.approx(0.001)
    records = []
    for t_fused in (0.040, limit["t_link_s"] - 0.0005, 0.080):
        r = {"op": "o", "shape": {"t": t_fused}, "t_fused_s": t_fused, **limit}
        r["beats_limit"] = beats_limit(r)
        records.append(r)
    assert [r["beats_limit"] for r in records] == [True, False, False]
    assert limit["t_limit_s"] / records[0]["t_fused_s"] > 1  # the efficiency it would report
    # the summary counts and names it
    for r in records:
        r.update(comm_ratio=1.0, t_unfused_s=0.1, t_unfused_one_call_s=0.2, speedup=0.1 / r["t_fused_s"],
                 speedup_one_call=0.2 / r["t_fused_s"], efficiency=r["t_limit_s"] / r["t_fused_s"],
                 t_beside_s=0.07, efficiency_vs_beside=0.07 / r["t_fused_s"], correct=True,
                 peak_bytes_fused=1, peak_bytes_unfused=1)
    summary = summarize(records)
    assert summary["beats_physical_limit"] == 1
    assert summary["beats_limit"] == ["o {'t': 0.04} (link)"]
    assert summary["median_speedup_balanced"] == pytest.approx(0.1 / records[1]["t_fused_s"])
    # compute-bound: the limit is compute alone, with the burst still allowed
    slow = physical_limit(t_compute=0.5, t_comm=0.1, link_bytes=2**20, link="50mbit")  # 168 ms
    assert (slow["t_limit_s"], slow["limit_tolerance_s"]) == (0.5, pytest.approx(64 * 1024 * 8 / 50e6))



def test_two_transports_summarize_each_and_together(records):
    """``--transport shm,gloo``: a summary per transport, shm's fused against gloo's unfused
    shape by shape, and ``all_correct`` over both, which the exit status reads (the CLI
    read it from a two-transport summary that lacked it, and ended in a traceback)."""
    from plait.bench.ops import summarize_transports

    gloo = [{**r, "transport": "gloo"} for r in records]
    shm = [{**r, "transport": "shm", "t_fused_s": r["t_unfused_s"] / 2} for r in records]
    out = summarize_transports(gloo + shm)
    assert out["all_correct"] is True and set(out["shm"]) == set(out["gloo"])
    assert out["gloo_unfused_over_shm_fused"] == [2.0] * len(records)
    assert out["gloo_unfused_over_shm_limit_median"] == pytest.approx(median(
        [r["t_unfused_s"] / r["t_limit_s"] for r in records]))
    assert out["gloo_unfused_over_shm_compute_median"] == pytest.approx(median(
        [r["t_unfused_s"] / r["t_compute_s"] for r in records]))
    shm[-1] = {**shm[-1], "correct": False}
    assert summarize_transports(gloo + shm)["all_correct"] is False


@pytest.mark.parametrize("call_s, min_time_s, rounds", [
    (0.005, 0.25, 44),   # a 5 ms call: 50 rounds would make 0.25 s, capped at 4 × 11
    (0.012, 0.25, 21),   # 0.25 / 0.012 = 20.8
    (0.080, 0.25, 11),   # long enough at --iters
    (0.005, 0.0, 11),    # 0: --iters exactly
])
def test_a_short_call_is_timed_more_rounds(monkeypatch, call_s, min_time_s, rounds):
    """The rounds follow the call's reading (fed here, not measured): at least --iters, up
    to 4 ×, enough for min_time_s a variant."""
    import plait.bench.ops as ops

    monkeypatch.setattr(ops, "time_once", lambda call, device=None: call_s)
    cfg = OpsBenchConfig(sweep=SWEEP, iters=11, min_time_s=min_time_s)
    assert ops._rounds(cfg, lambda: None, None) == rounds

