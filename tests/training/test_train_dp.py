"""``plait train --dp 2 --tp 2``: the training loop on 4 ranks against one process on the global
batch, written out here (the same seed, batches, AdamW and schedule; no plait layer).

In float64 (the default dtype on every rank, as tests/training/test_train.py runs its GPTs), for
plait's GPT with tp groups inside a host ([0, 1], [2, 3]) and the transformers Llama with tp
groups across hosts (``--tp-across-hosts``: [0, 2], [1, 3]), one launch: every step's logged
loss (the replicas' mean, each replica on half the rows) and the held-out loss equal the one
process's within 1e-9, and every rank logs the same. Refused in one line, exit status 2,
before anything starts: --dp × --tp that is not the number of ranks; --dp 2 with a model
it is not built for; --balance with --dp 2 and fused layers (a balanced run is data-parallel
by DDP, which needs --no-overlap; the balancer under dp 2 is tests/balance/test_balance_dp.py).
"""

import pytest
import torch

from plait.cli.main import main
from plait.training.data import CharCorpus
from plait.models import GPT
from plait.testing import run_ranks
from plait.training.config import TrainConfig
from plait.training.models import evaluate_gpt, gpt_loss, hf_loss
from plait.training.run import train_rank
from plait.training.hf import hf_model
from test_train import fit

TOL = 1e-9
SIZES = dict(steps=6, n_layer=1, n_embd=32, seq_len=16, batch_size=8, lr=1e-2,
             eval_batches=2, chunks="2", dp=2, tp=2)
CONFIGS = {"gpt": TrainConfig(model="gpt", n_head=4, **SIZES),
           "hf-llama": TrainConfig(model="hf-llama", n_head=4, kv_heads=2, tp_across_hosts=True,
                                   **SIZES)}


def _both_fp64() -> dict:
    torch.set_default_dtype(torch.float64)
    return {name: train_rank(cfg) for name, cfg in CONFIGS.items()}


def _reference(cfg: TrainConfig) -> tuple[list[float], float]:
    """(every step's loss, the held-out loss) of the plain model in this process, float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        corpus = CharCorpus.load()
        if cfg.model == "gpt":
            torch.manual_seed(cfg.seed)
            model, loss_fn = GPT(cfg.gpt_config(corpus.vocab_size)), gpt_loss
        else:
            model, loss_fn = hf_model(cfg, corpus.vocab_size), hf_loss
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        batches = corpus.batches("train", cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
        losses = fit(model, optimizer, loss_fn, batches, cfg)
        return losses, evaluate_gpt(model, corpus, cfg)["heldout_loss"]
    finally:
        torch.set_default_dtype(previous)


def test_dp2_tp2_matches_one_process_on_the_global_batch():
    pytest.importorskip("transformers")
    results = run_ranks(_both_fp64, 4, timeout_s=120)
    for name, cfg in CONFIGS.items():
        want, want_heldout = _reference(cfg)
        placement = results[0][name]["placement"]
        groups = "[[0, 1], [2, 3]]" if name == "gpt" else "[[0, 2], [1, 3]]"
        assert placement.startswith(f"dp 2 × tp 2: tp groups {groups}"), placement
        for rank, out in enumerate(results):
            got = [r["loss"] for r in out[name]["records"]]
            assert got == pytest.approx(want, rel=0, abs=TOL), (name, rank, got, want)
            assert out[name]["eval"]["heldout_loss"] == pytest.approx(want_heldout, abs=TOL)
            assert "over 2 replicas" in out[name]["parallel"], out[name]["parallel"]
        assert want[-1] < want[0], want  # it learns


@pytest.mark.parametrize("flags,line", [
    (["--dp", "2", "--tp", "3"], "--dp 2 × --tp 3 = 6 ranks, but the run has 4"),
    (["--dp", "3", "--batch-size", "12"], "--dp 3 does not divide 4 ranks"),
    (["--dp", "2", "--model", "dlrm"], "--dp 2 applies to --model gpt and hf-llama, not to "
                                       "dlrm"),
    (["--dp", "2", "--balance", "semi"], "--balance semi with --dp 2 needs --no-overlap: "
                                         "after a migration data parallelism is rebuilt by "
                                         "DDP (FSDP2's re-sharding is not built)"),
])
def test_refused_in_one_line(flags, line, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--ranks", "4", "--out", str(out), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert line in err and "\n" not in err, err
    assert not out.exists()  # refused before the report folder is made
