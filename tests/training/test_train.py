"""``plait train``'s loop on 2 and 3 ranks (uneven shards) against the same run in one process
on the plain model, written out here: the same seed, batches, AdamW and schedule.

The GPTs run in float64, where tensor parallelism changes nothing but the order of a few
sums: every step's loss agrees to 1e-12. DLRM's click log is float32 (ClickLog makes its
dense features in float32), so it is compared in float32, where its batch-split MLPs sum
in another order: 1e-5. Then what the run must have learnt: the GPTs beat the best model
of single-character frequencies (the most frequent held-out character and the unigram
cross-entropy, measured here on the corpus; an untrained GPT scores 0.2 % and ln 97), and
DLRM beats always predicting the click rate, and closes a quarter of the gap between that
guess's loss and the planted model's.
"""

import json
import math

import pytest
import torch

from plait.cli.main import build_parser
from plait.training.data import CharCorpus, ClickLog
from plait.models import DLRM, GPT, DLRMConfig
from plait.testing import run_ranks
from plait.training.config import TrainConfig
from plait.training.loop import lr_at
from plait.training.models import dlrm_loss, evaluate_dlrm, evaluate_gpt, gpt_loss
from plait.training.run import train, train_rank
from plait.training.report import write_train_report

GPT_SIZES = dict(steps=16, n_layer=1, n_head=4, n_embd=32, seq_len=16, batch_size=8, lr=1e-2,
                 eval_batches=4)
CASES = [  # (id, ranks, dtype, config)
    ("gpt-sp-2", 2, torch.float64,
     dict(model="gpt", sequence_parallel=True, plans=("heads=3:1",), **GPT_SIZES)),
    ("gpt-microbatches-3", 3, torch.float64,
     dict(model="gpt", microbatches=2, plans=("mlp=64:32:32",), **GPT_SIZES)),
    ("moe-3", 3, torch.float64,
     dict(model="moe", plans=("heads=2:1:1", "experts=2:1:1"), **GPT_SIZES)),
    ("dlrm-2", 2, torch.float32,  # a planted logistic signal takes longer to find than spaces
     dict(model="dlrm", plans=("tables=5:3",), steps=30, batch_size=512, lr=3e-2,
          eval_batches=4)),
]
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _train_on_rank(cfg: TrainConfig, dtype: torch.dtype) -> dict:
    torch.set_default_dtype(dtype)
    return train_rank(cfg)


def fit(model, optimizer, loss_fn, batches, cfg: TrainConfig) -> list[float]:
    """``cfg.steps`` plain steps in this process, at train's learning-rate schedule: the
    one-process reference every train test compares with."""
    losses = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.steps, cfg.lr)
        loss = loss_fn(model, next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _reference(cfg: TrainConfig, dtype: torch.dtype) -> tuple[list[float], dict]:
    """The same training in this process, on the plain single-device model (no plait layer)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if cfg.model == "dlrm":
            data = ClickLog(DLRMConfig().table_sizes, DLRMConfig().dense_features, seed=cfg.seed)
            torch.manual_seed(cfg.seed)
            model, loss_fn = DLRM(DLRMConfig()), dlrm_loss
            batches = data.batches(cfg.batch_size, cfg.seed + 1)
        else:
            data = CharCorpus.load()
            torch.manual_seed(cfg.seed)
            model, loss_fn = GPT(cfg.gpt_config(data.vocab_size)), gpt_loss
            batches = data.batches("train", cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        losses = fit(model, optimizer, loss_fn, batches, cfg)
        evaluate = evaluate_dlrm if cfg.model == "dlrm" else evaluate_gpt
        return losses, evaluate(model, data, cfg)
    finally:
        torch.set_default_dtype(previous)


def _unigram_baseline() -> tuple[float, float]:
    """(accuracy of always guessing the most frequent held-out character, held-out
    cross-entropy of the training split's character frequencies): the best a model that
    reads no context can do."""
    corpus = CharCorpus.load()
    train_counts = torch.bincount(corpus.split("train"), minlength=corpus.vocab_size).double()
    held = torch.bincount(corpus.split("heldout"), minlength=corpus.vocab_size).double()
    freq = held / held.sum()
    log_p = torch.log((train_counts / train_counts.sum()).clamp_min(1e-12))
    return float(freq.max()), float(-(freq * log_p).sum())


def _click_rate_baseline(cfg: TrainConfig) -> tuple[float, float]:
    """(accuracy, loss) on evaluate_dlrm's held-out samples of always predicting their click
    rate: the best a model that reads no feature can do."""
    data = ClickLog(DLRMConfig().table_sizes, DLRMConfig().dense_features, seed=cfg.seed)
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    labels = torch.cat([data.sample(cfg.batch_size, gen)[3] for _ in range(cfg.eval_batches)])
    rate = float(labels.double().mean())
    return max(rate, 1 - rate), -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))


@pytest.mark.parametrize("ranks,dtype,fields", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_train_matches_one_process_and_learns(ranks, dtype, fields, tmp_path):
    cfg = TrainConfig(chunks="2", extra={"ranks": ranks}, **fields)
    cfg.check_plans(ranks)
    results = run_ranks(_train_on_rank, ranks, cfg, dtype)
    ref_losses, ref_eval = _reference(cfg, dtype)
    rtol = RTOL[dtype]
    for rank, result in enumerate(results):
        records = result["records"]
        assert [r["step"] for r in records] == list(range(cfg.steps)), (rank, len(records))
        assert [r["lr"] for r in records] == [lr_at(s, cfg.steps, cfg.lr) for s in range(cfg.steps)]
        losses = [r["loss"] for r in records]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert worst <= rtol, f"rank {rank}: loss {worst:.2e} from one process's (rtol {rtol:g})"
        assert result["eval"]["heldout_loss"] == pytest.approx(ref_eval["heldout_loss"], rel=rtol)
        # a prediction decided by a near-tie may flip on the last bit: one token or sample
        samples = cfg.eval_batches * cfg.batch_size * (1 if cfg.model == "dlrm" else cfg.seq_len)
        assert abs(result["eval"]["heldout_accuracy"] - ref_eval["heldout_accuracy"]) <= 1 / samples
        assert f"on {ranks} ranks" in result["parallel"], result["parallel"]
        assert any("fused" in line for line in result["paths"]), result["paths"]

    final, losses = results[0]["eval"], ref_losses
    if cfg.model == "dlrm":
        guess_acc, guess_loss = _click_rate_baseline(cfg)
        floor = final["planted_model_loss"]
        assert sum(losses[:3]) / 3 > math.log(2) - 0.05, losses[:3]  # it starts as a coin
        closed = (guess_loss - final["heldout_loss"]) / (guess_loss - floor)
        assert closed > 0.25, (final, guess_loss)  # of the way to the planted model
        assert final["heldout_accuracy"] > guess_acc + 0.1, (final, guess_acc)
    else:
        best_guess, unigram_loss = _unigram_baseline()
        assert sum(losses[:3]) / 3 > math.log(97) - 0.3, losses[:3]  # it starts untrained
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
        assert final["heldout_loss"] < unigram_loss - 0.15, (final, unigram_loss)
        assert final["heldout_accuracy"] > best_guess + 0.04, (final, best_guess)

    summary = write_train_report(results[0], cfg, tmp_path, "loopback", wall_s=1.0)
    log = json.loads((tmp_path / "log.json").read_text())
    losses = [r["loss"] for r in results[0]["records"]]
    tenth = max(1, cfg.steps // 10)
    assert [r["loss"] for r in log["records"]] == losses and summary["first_loss"] == losses[0]
    assert summary["last_tenth_mean_loss"] == pytest.approx(sum(losses[-tenth:]) / tenth)
    assert log["meta"]["summary"]["heldout_accuracy"] == final["heldout_accuracy"]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_from_flags_and_its_errors():
    args = build_parser().parse_args(["train", "--model", "moe", "--plans",
                                      "heads=3:1,experts=1:3", "--no-overlap", "--steps", "5"])
    from plait.cli.args import dataclass_from_args

    cfg = dataclass_from_args(TrainConfig, args)
    assert cfg.steps == 5 and not cfg.overlap and cfg.batch_size == 16
    assert cfg.shard_plans()["experts"].sizes == (1, 3)
    with pytest.raises(ValueError, match="--model must be one of"):
        TrainConfig(model="bert")
    with pytest.raises(ValueError, match="cannot read --plans entry 'heads=3;1'"):
        TrainConfig(plans=("heads=3;1",))
    with pytest.raises(ValueError, match="--steps must be positive"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="sequence-parallel applies to the GPT models"):
        TrainConfig(model="dlrm", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"--plans heads: shard sizes \[4, 0\] leave rank 1 with no heads"):
        train(TrainConfig(plans=("heads=4:0",)), ranks=2)  # refused before any rank starts
    with pytest.raises(ValueError, match="--microbatches 2 applies to --model gpt, fused"):
        TrainConfig(model="moe", microbatches=2)
    with pytest.raises(ValueError, match="--microbatches 2 applies to --model gpt, fused"):
        TrainConfig(microbatches=2, overlap=False)
    with pytest.raises(ValueError, match="does not apply to --model dlrm"):
        TrainConfig(model="dlrm", plans=("heads=2:2",)).check_plans(2)
