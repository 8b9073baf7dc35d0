"""A balanced run resumed from a checkpoint taken while the balancer had a rank resized goes
on with exactly the losses, and the decisions, of the run never stopped.

Each rank runs ``plait train``'s own (``plait.training.run.train_rank``), whose ``resume_run`` and
``checkpoint_after`` are given its ``RankParallel``, so the checkpoints hold each rank's
balancer state and a resume restores it (``plait.training.resume.restore_balancer``). Rank 1 is 4 × slower at
compute (straggler emulation) and every rank a virtual device (timed by its products' FLOPs,
:mod:`plait.testing.virtual`), so the semi policy resizes it to half its heads and MLP columns
(``max_skip`` 0.5 clips it) at step 10 exactly (3 warm-up steps, the window half full after
step 8, confirmed over 3 steps), and would migrate only from step 19 on (``spike_steps``
12); the run stops at 18.

1. One run of 18 steps, float64, checkpointing every 4 steps (keeping 5): its records and
   decisions. Its checkpoints up to step-12 are copied to another directory, as if it had
   been killed after step-12 was published (with rank 1 resized since step 10).
2. In the same two ranks (one launch: each spawn imports ``plait.training.run`` anew, ~10 s on a
   loaded machine), everything built anew (model, optimizer, ``RankParallel`` and its
   balancer, data stream; the RNGs come from the checkpoint), a run resumed from the
   copy: every step's loss and learning rate equal the first run's, bit for bit, and so
   do the balancer's decisions and final state; the resume line says the balancer was
   restored. Without the restore (the balancer starting afresh, as ``plait train`` did
   before it handed its ``RankParallel`` over) step 12's loss already differs: rank 1 computes all its features again.
"""

import torch

from plait.runtime.launch import launch
from plait.runtime.slow.straggler import parse_slow
from plait.training.config import TrainConfig

from _resume import killed_then_resumed

STEPS, EVERY, RESUME_AT = 18, 4, 12
SIZES = dict(model="gpt", steps=STEPS, n_layer=1, n_head=4, n_embd=32, seq_len=16,
             batch_size=8, lr=1e-2, eval_batches=0, balance="semi",
             checkpoint_every=EVERY, checkpoint_keep=5)
SLOW = [parse_slow("1:4")]


def _train_rank(cfg: TrainConfig) -> dict:
    """``plait train``'s rank (``plait.training.run.train_rank``) in float64, and what it reports."""
    from plait.training.run import train_rank

    torch.set_default_dtype(torch.float64)
    out = train_rank(cfg)
    return {"records": out["records"], "resumed": out["resumed"],
            "decisions": out["balance"]["decisions"], "final": out["balance"]["final_state"]}


def _killed_then_resumed(cfg: TrainConfig, resumed_dir: str):
    return killed_then_resumed(cfg, resumed_dir, _train_rank, EVERY, RESUME_AT)


def test_balanced_run_resumes_with_its_balancer(tmp_path):
    cfg = TrainConfig(**SIZES, checkpoint_dir=str(tmp_path / "ckpt"))
    copy = tmp_path / "resumed"
    results = launch(_killed_then_resumed, 2, args=(cfg, str(copy)), slow=SLOW, threads=1,
                     timeout_s=60, deadline_s=300)
    before, after = [r[0] for r in results], [r[1] for r in results]
    decisions = before[0]["decisions"]
    print("decisions of the run never stopped:", [(d["step"], d["dim"], d["kind"],
                                                     d.get("fractions")) for d in decisions])
    # what the test is about: rank 1 resized before the checkpoint, nothing after it
    assert [(d["step"], d["dim"], d["kind"], d["fractions"]) for d in decisions] == [
        (10, dim, "resize", [1.0, 0.5]) for dim in ("blocks.0.attn", "blocks.0.mlp")], decisions
    assert [r["final"]["blocks.0.mlp"]["keep"] for r in before] == [1.0, 0.5], before
    line = after[0]["resumed"]
    print(line)
    assert line.startswith(f"resumed from {copy}/step-{RESUME_AT} at step {RESUME_AT} (the "
                           "same 2 ranks and plans); balancer restored at its step "
                           f"{RESUME_AT} ({len(decisions)} decisions"), line
    old, new = before[0]["records"], after[0]["records"]
    assert [r["step"] for r in new] == list(range(STEPS))
    for a, b in zip(old, new):  # step by step, bit for bit
        assert (a["step"], a["loss"], a["lr"]) == (b["step"], b["loss"], b["lr"]), (a, b)
    for r in range(2):
        assert after[r]["decisions"] == before[r]["decisions"]
        assert after[r]["final"] == before[r]["final"]
