"""A balanced run resumed from a checkpoint taken while the balancer had a rank resized goes
on with exactly the losses, and the decisions, of the run never stopped.

The loop is ``plait train``'s (``plait.train.train_rank``): the GPT built by ``build_gpt``,
``RankParallel`` for ``--balance semi`` with its settings, the seeded data stream, AdamW
and the learning-rate schedule of ``train_steps``; ``resume_run`` and ``checkpoint_after``
are given the ``RankParallel``, so the checkpoints hold each rank's balancer state and a
resume restores it (``plait.train_resume.restore_balancer``). Rank 1 is 4 × slower at
compute (straggler emulation): the semi policy resizes it to half its heads and MLP
columns (``max_skip`` 0.5 clips it, so the fractions do not follow the timings' noise) at
step 10, and would migrate only from step 19 on (``spike_steps`` 12); the run stops at 18.

1. One run of 18 steps, float64, checkpointing every 4 steps (keeping 5): its records and
   decisions. Its checkpoints at steps 16 and 18 are removed, as if it had been killed
   after step-12 was published (with rank 1 resized since step 10).
2. A resume from step-12: every step's loss and learning rate equal the first run's, bit
   for bit, and so do the balancer's decisions and final state; the resume line says the
   balancer was restored. Without the restore (the balancer starting afresh, as before
   this test) step 12's loss already differs: rank 1 computes all its features again.
"""

import shutil

import pytest
import torch

from plait.runtime.launch import launch
from plait.runtime.testing import run_ranks
from plait.runtime.straggler import parse_slow
from plait.train import TrainConfig

STEPS, EVERY, RESUME_AT = 18, 4, 12
SIZES = dict(model="gpt", steps=STEPS, n_layer=1, n_head=4, n_embd=32, seq_len=16,
             batch_size=8, lr=1e-2, eval_batches=0, balance="semi",
             checkpoint_every=EVERY, checkpoint_keep=5)
SLOW = [parse_slow("1:4")]


def _train_rank(cfg: TrainConfig) -> dict:
    """``plait.train.train_rank``'s GPT loop with the balancer handed to the checkpoints."""
    from plait.checkpoint import SeededStream
    from plait.data import CharCorpus
    from plait.train import build_gpt, gpt_loss, train_steps
    from plait.train_parallel import RankParallel
    from plait.train_resume import checkpoint_after, resume_run

    torch.set_default_dtype(torch.float64)
    corpus = CharCorpus.load()
    run = RankParallel(cfg)
    model = run.wrap(build_gpt(cfg, run.tp_group, vocab_size=corpus.vocab_size))
    stream = SeededStream(lambda gen: corpus.batch("train", cfg.batch_size, cfg.seq_len, gen),
                          cfg.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    run.attach(model, optimizer)
    ckpt, first, done, line = resume_run(cfg, model, optimizer, stream, run)
    on_step = checkpoint_after(run.after_step, cfg, ckpt, model, optimizer, stream, done, run)
    history = train_steps(model, optimizer, run.replica_rows(stream), gpt_loss, cfg.steps,
                          peak_lr=cfg.lr, on_step=on_step, start=first)
    ckpt.wait()
    return {"records": done + history, "resumed": line,
            "decisions": [d.to_json() for d in run.balancer.log],
            "final": run.balancer.state(), "keep": model.blocks[0].mlp.fc.keep}


def _run(cfg):
    return launch(_train_rank, 2, args=(cfg,), slow=SLOW, threads=1, timeout_s=60,
                  deadline_s=300)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("balanced") / "ckpt"
    results = _run(TrainConfig(**SIZES, checkpoint_dir=str(ckpt)))
    for name in ("step-16", "step-18"):  # killed after step-12 was published
        shutil.rmtree(ckpt / name)
    yield ckpt, results
    shutil.rmtree(ckpt.parent, ignore_errors=True)


def test_balanced_run_resumes_with_its_balancer(first_run, tmp_path):
    ckpt, before = first_run
    decisions = before[0]["decisions"]
    print("decisions of the run never stopped:", [(d["step"], d["dim"], d["kind"],
                                                     d.get("fractions")) for d in decisions])
    # what the test is about: rank 1 resized before the checkpoint, nothing after it
    assert decisions and all(d["kind"] == "resize" and d["step"] < RESUME_AT
                             for d in decisions), decisions
    assert [r["keep"] for r in before] == [1.0, 0.5]
    copy = shutil.copytree(ckpt, tmp_path / "ckpt")
    after = _run(TrainConfig(**SIZES, checkpoint_dir=str(copy), resume=True))
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
        assert (after[r]["final"], after[r]["keep"]) == (before[r]["final"], before[r]["keep"])


# --- the balancer's state itself, with no timing in the way ----------------------------

def _tensors_differ(a, b, path=""):
    """Where two nested states differ (tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(a) != sorted(b):
            return [f"{path}: keys"]
        return [p for k in a for p in _tensors_differ(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length"]
        return [p for i, (x, y) in enumerate(zip(a, b))
                for p in _tensors_differ(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def _balanced(seed):
    """The float64 checkpoint GPT on 2 ranks under a balancer (policy even: it decides
    nothing itself; the test applies a migration and a resizing through it), refreshing
    the priority scores every 2 steps."""
    from plait.balance import Balancer, PolicyConfig

    from _ckpt_gpt import build

    model, opt = build(seed=seed)
    return model, opt, Balancer(model, opt, None, PolicyConfig(name="even"), refresh=2,
                                warmup=0)


def _steps(model, opt, balancer, batches, first):
    losses = []
    for i, (idx, targets) in enumerate(batches):
        loss = model(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        balancer.step(first + i)
        losses.append(loss.item())
    return losses


def _round_trip(root):
    from plait import checkpoint
    from plait.balance import Action
    from plait.nn import ShardPlan

    from _ckpt_gpt import batches

    data = batches(8)
    model, opt, bal = _balanced(seed=0)
    _steps(model, opt, bal, data[:2], 0)
    heads = ShardPlan((7, 3))
    bal._apply(2, "blocks.0.attn", Action("migrate", "test: heads [7, 3]", plan=heads))
    bal._apply(2, "blocks.1.mlp", Action("resize", "test: rank 1 keeps half",
                                         fractions=(1.0, 0.5)))
    _steps(model, opt, bal, data[2:5], 2)  # refreshed at 4: scores by change, resized
    saved = bal.state_dict()
    checkpoint.Checkpointer(root).save(5, model, opt, rank_state={"balancer": saved})
    go_on = _steps(model, opt, bal, data[5:], 5)  # refreshed at 6 from the snapshot at 4
    after = bal.state_dict()

    model2, opt2, bal2 = _balanced(seed=1)  # even plans, other weights, fresh readings
    found = checkpoint.Checkpointer(root).load(model2, opt2)
    moved = bal2.load_state_dict(found.rank_state["balancer"])
    restored = _tensors_differ(bal2.state_dict(), saved)
    resumed = _steps(model2, opt2, bal2, data[5:], 5)
    return (moved, list(model2.blocks[0].attn.qkv.plan.sizes), restored, go_on, resumed,
            _tensors_differ(bal2.state_dict()["dims"], after["dims"]),
            [layer["keep"] for layer in after["dims"]["blocks.1.mlp"]["layers"]])


def test_balancer_state_round_trips_and_moves_back_to_its_plans(tmp_path):
    for r, out in enumerate(run_ranks(_round_trip, 2, str(tmp_path / "ckpt"))):
        moved, plan, restored, go_on, resumed, later, keeps = out
        assert (moved, plan) == (["blocks.0.attn"], [7, 3]), r  # migrated back to its plan
        assert keeps == ([1.0, 1.0] if r == 0 else [0.5, 0.5]), r  # rank 1 resized
        assert restored == [], (r, restored)
        assert resumed == go_on, r  # bit for bit
        # the scores refreshed after the resume, from the restored snapshot, are the same
        assert later == [], (r, later)
