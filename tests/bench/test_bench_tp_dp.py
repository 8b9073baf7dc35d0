"""plait bench tp --dp 2 --tp 2: both placements of a dp × tp mesh trained side by side
(plait's fused TP, PyTorch's data parallelism), with the performance model's prediction of
each (plait.perf.placement).

On loopback, 4 ranks (no emulated hosts: every group stays on the machine): the two
placements' losses agree with each other (fp32, 1e-5 over the timed steps) and with one
process training the same GPT on the global batch (1e-4); each record names its tp and dp
groups and carries the prediction the model makes from the figures it recorded. Bad
--dp/--tp are refused before anything starts. Without processes: the model's numbers
follow from its inputs by hand, and tensor parallelism across a slow shared link is
predicted slower than inside a host.
"""

import io

import pytest
import torch
from rich.console import Console

from plait.bench.tp import TPBenchConfig, bench_tp, summarize_tp
from plait.bench.tp_dp import print_placements
from plait.perf.placement import (Hardware, StepWork, allreduce_time, predict_placement,
                                  predict_placements)

TINY = dict(dp=2, tp=2, n_layer=1, n_head=4, n_embd=32, seq_len=16, batch_size=4, warmup=1,
            steps=3, compare_steps=4)


@pytest.fixture(scope="module")
def records():
    records, where = bench_tp(TPBenchConfig(**TINY), ranks=4, hosts=0)
    assert "loopback" in where
    return records


def one_process_losses(cfg: TPBenchConfig) -> list[float]:
    """The same GPT, batches and AdamW in one process, on the whole global batch."""
    from plait.training.data import CharCorpus
    from plait.training.models import build_gpt, gpt_loss

    corpus = CharCorpus.load()
    model = build_gpt(cfg.train_config(overlap=False), vocab_size=corpus.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    stream = corpus.batches("train", cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
    losses = []
    for _ in range(cfg.total_steps):
        loss = gpt_loss(model, next(stream))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_both_placements_train_the_global_batch(records):
    by = {r["placement"]: r for r in records}
    assert set(by) == {"tp-inside-host", "tp-across-hosts"}
    assert by["tp-inside-host"]["tp_groups"] == [[0, 1], [2, 3]]
    assert by["tp-inside-host"]["dp_groups"] == [[0, 2], [1, 3]]
    assert by["tp-across-hosts"]["tp_groups"] == [[0, 2], [1, 3]]
    assert by["tp-across-hosts"]["dp_groups"] == [[0, 1], [2, 3]]
    reference = one_process_losses(TPBenchConfig(**TINY))
    for r in records:
        assert r["system"] == "plait" and r["part"] == "placement"
        assert r["world_size"] == 4 and r["dp"] == 2 and r["tp"] == 2
        assert r["dp_kind"] == "FSDP2"  # fused row-parallel layers: DDP would miss gradients
        assert r["across_hosts"] == "nothing (one machine)" and r["link"] == "loopback"
        assert "one machine (loopback)" in r["placement_line"]
        assert len(r["losses"]) == len(r["step_times_s"]) == 4 and r["t_step_s"] > 0
        assert r["losses"] == pytest.approx(reference, abs=1e-4)  # fp32, other sum orders
        assert r["max_loss_diff_timed"] <= 1e-5
        assert r["loss_diff_vs"] != r["placement"]
    assert reference[-1] < reference[0]
    summary = summarize_tp(records)
    assert summary["placement_losses_agree_1e-5"] is True
    assert "plait_speedup_vs_pytorch_tp" not in summary


def test_records_carry_the_models_prediction(records):
    for r in records:
        work, hw = StepWork(**r["work"]), Hardware(**r["hardware"])
        assert hw.hosts == 0 and hw.inter_Bps is None  # loopback: no slow link
        assert work.dp == 2 and work.tp == 2 and work.tp_allreduces == 4
        assert work.tp_allreduce_bytes == 2 * 16 * 32 * 4  # [B/dp, S, D] fp32
        assert work.dp_kind == "fsdp"
        predicted = predict_placement(work, hw, r["placement"])
        assert r["predicted_step_s"] == predicted.step_s > 0
        assert r["prediction"]["tp_groups"] == r["tp_groups"]  # its own placement's
        assert r["prediction"]["compute_s"] == pytest.approx(work.flops / hw.flops_per_s)
    out = Console(file=io.StringIO(), width=250)
    print_placements(records, to=out)
    text = out.file.getvalue()
    assert "tp-inside-host" in text and "tp-across-hosts" in text and "predicted" in text
    inside = next(r for r in records if r["placement"] == "tp-inside-host")
    assert f"{inside['predicted_step_s'] * 1e3:.1f}" in text


@pytest.mark.parametrize("kw, world, message", [
    (dict(dp=0), None, "--dp must be a positive integer, got 0"),
    (dict(dp=2, tp=0), None, "--tp must be a positive integer, got 0"),
    (dict(dp=2, tp=2), 2, r"--dp 2 × --tp 2 = 4 ranks, but the run has 2"),
    (dict(dp=2, tp=1), 2, "both placements are the same"),
    (dict(dp=3, batch_size=12), 4, r"--dp 3 × --tp 1 = 3 ranks, but the run has 4"),
    (dict(dp=3, batch_size=16), None, "--batch-size 16 does not split evenly over --dp 3"),
    (dict(dp=2, systems=("pytorch-tp",)), None, "compares placements of plait and plait-plain"),
    (dict(dp=2, n_head=4, n_embd=48), 6, "--n-head 4 does not split over --tp 3"),
])
def test_bad_dp_tp_are_refused(kw, world, message):
    with pytest.raises(ValueError, match=message):
        cfg = TPBenchConfig(**kw)
        bench_tp(cfg, ranks=world)  # refused before any rank starts


def test_dp_1_is_the_bench_as_before():
    cfg = TPBenchConfig()
    assert cfg.systems == ("plait", "plait-plain", "pytorch-tp") and cfg.runs_dlrm
    assert cfg.resolved(2).tp == 2 and cfg.mesh_ranks is None
    assert TPBenchConfig(dp=2, tp=2).systems == ("plait",)
    assert TPBenchConfig(dp=2, tp=2).mesh_ranks == 4 and not TPBenchConfig(dp=2).runs_dlrm


# --- the model, by hand ---------------------------------------------------------------------

MiB = 1024 * 1024
WORK = StepWork(dp=2, tp=2, flops=1e9, layers=2, tp_allreduces=8, tp_allreduce_bytes=4 * MiB,
                dp_bytes=1 * MiB)
HW = Hardware(hosts=2, flops_per_s=1e10, intra_Bps=1e9, inter_Bps=1.25e8, latency_s=1e-4)


def test_tp_across_a_slow_shared_link_is_predicted_slower():
    p = predict_placements(WORK, HW)
    inside, across = p["tp-inside-host"], p["tp-across-hosts"]
    assert inside.across_hosts == "dp" and across.across_hosts == "tp"
    assert across.step_s > 2 * inside.step_s  # 8 all-reduces of 4 MiB on the slow link
    # the same on one machine: nothing crosses, the placements cost the same
    flat = predict_placements(WORK, Hardware(hosts=0, flops_per_s=1e10, intra_Bps=1e9))
    assert flat["tp-inside-host"].step_s == flat["tp-across-hosts"].step_s


def test_the_numbers_follow_from_the_inputs():
    compute = 1e9 / 1e10
    # tp inside a host: each rank sends its successor 2(n−1)/n of 4 MiB at 1 GB/s
    tp_inside = 4 * MiB / 1e9
    # dp across: both dp groups ([0, 2], [1, 3]) leave host 0 over its one link
    dp_across = 2 * 1e-4 + 2 * MiB / 1.25e8
    inside = predict_placement(WORK, HW, "tp-inside-host")
    assert inside.tp.call_s == pytest.approx(tp_inside) and inside.tp.sharing == 0
    assert inside.dp.call_s == pytest.approx(dp_across) and inside.dp.sharing == 2
    tp_part = 8 * (compute / 8 + tp_inside)  # one piece: compute, then the all-reduce
    assert inside.tp_part_s == pytest.approx(tp_part)
    # gradients go block by block as each backward ends; the last block's is exposed
    assert inside.dp_exposed_s == pytest.approx(dp_across / 2)
    assert inside.step_s == pytest.approx(tp_part + dp_across / 2)
    across = predict_placement(WORK, HW, "tp-across-hosts")
    tp_across = 2 * 1e-4 + 2 * 4 * MiB / 1.25e8
    assert across.tp.call_s == pytest.approx(tp_across)
    assert across.step_s == pytest.approx(8 * (compute / 8 + tp_across) + MiB / 1e9 / 2)


def test_pieces_hide_tp_comm_and_fsdp_gathers_before_each_block():
    fused = predict_placement(StepWork(**{**vars(WORK), "tp_pieces": 2}), HW, "tp-across-hosts")
    c, m = 1e9 / 1e10 / 8, allreduce_time(4 * MiB, 2, 2, HW)
    assert fused.tp_part_s == pytest.approx(8 * (c / 2 + m / 2 + max(c, m) / 2))
    one = StepWork(dp=2, tp=1, flops=3e9, layers=1, tp_allreduces=0, tp_allreduce_bytes=0,
                   dp_bytes=MiB, dp_kind="fsdp")
    p = predict_placement(one, Hardware(hosts=0, flops_per_s=1e10, intra_Bps=1e9),
                          "tp-inside-host")
    g = p.dp.call_s / 3  # 3 · (n−1)/n of the parameter bytes: gather, gather, scatter
    assert p.dp.call_s == pytest.approx(1.5 * MiB / 1e9)
    # the first gather before the forward; the backward's is prefetched under the forward;
    # the gradients' scatter after the backward
    assert p.step_s == pytest.approx(g + 0.1 + 0.2 + g)


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="StepWork.dp_kind must be one of ddp, fsdp"):
        StepWork(**{**vars(WORK), "dp_kind": "zero"})
    with pytest.raises(ValueError, match="2 hosts need a link rate"):
        Hardware(hosts=2, flops_per_s=1e10, intra_Bps=1e9)
    with pytest.raises(ValueError, match="placement 'diagonal'"):
        predict_placement(WORK, HW, "diagonal")
    with pytest.raises(ValueError, match="4 ranks do not split over 3 hosts"):
        predict_placement(WORK, Hardware(hosts=3, flops_per_s=1, intra_Bps=1, inter_Bps=1),
                          "tp-inside-host")


def test_simulate_placements_predicts_a_bench_run_again(records, tmp_path):
    """``plait simulate --placements`` reads a bench's JSON and predicts each placement from
    the figures it recorded; ``--link`` predicts it at another rate between hosts (the records ran on
    loopback: here they say 2 hosts at 1 Gbit/s and 1 GB/s inside a host)."""
    import json

    from plait.bench.report import write_json
    from plait.cli.main import main

    two_hosts = [{**r, "hardware": {**r["hardware"], "hosts": 2, "inter_Bps": 1.25e8,
                                    "intra_Bps": 1e9, "intra_latency_s": 0.0}}
                 for r in records]
    path = write_json(tmp_path / "bench.json", two_hosts)
    out = tmp_path / "sim.json"
    assert main(["simulate", "--placements", str(path), "--json", str(out)]) == 0
    again = {r["placement"]: r for r in json.loads(out.read_text())["records"]}
    slow = {k: predict_placement(StepWork(**r["work"]), Hardware(**r["hardware"]), k).step_s
            for k, r in again.items()}
    assert {k: r["predicted_step_s"] for k, r in again.items()} == slow
    assert main(["simulate", "--placements", str(path), "--link", "100mbit", "--json",
                 str(out)]) == 0
    slower = {r["placement"]: r for r in json.loads(out.read_text())["records"]}
    for k, r in slower.items():  # each placement has an axis on the link: both slow down
        assert r["hardware"]["inter_Bps"] == 1.25e7 and r["link_predicted"] == "100mbit"
        assert r["predicted_step_s"] > slow[k]
    assert slower["tp-across-hosts"]["across_hosts"] == "tp"
    assert main(["simulate", "--link", "1gbit"]) == 2  # --link without --placements
