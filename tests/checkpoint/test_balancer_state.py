"""The balancer's own state through a checkpoint, with no timing in the way.

Two ranks, the float64 GPT of ``_ckpt_gpt`` under a ``Balancer`` (policy ``even``: it
decides nothing itself, so no timing decides anything; the test applies a migration and a
resizing through the balancer's own ``_apply``), refreshing the priority scores every 2
steps. After 5 steps (heads migrated to [7, 3] at step 2, rank 1 resized to half its
columns of block 1's MLP, scores refreshed by change at step 4) the model, AdamW and each
rank's ``Balancer.state_dict()`` are checkpointed; the run goes on 3 steps. A model built
from another seed under the even plans, with a fresh optimizer and balancer, loads the
checkpoint and ``load_state_dict``: it migrates back to heads [7, 3], its state equals
the saved one bit for bit (snapshots and scores included), and its next 3 losses, and
the scores refreshed at step 6 from the restored snapshot, equal the run's. A balancer of
another policy (semi) handed the same checkpoint by ``restore_balancer`` starts afresh,
says why in one line, and nothing of it, nor the model's plans, changes.
"""

import torch

from plait.testing import run_ranks


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

    from _ckpt_gpt import batches, build

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

    # a balancer of another policy starts afresh, and says why; nothing of it changes
    from types import SimpleNamespace

    from plait.balance import Balancer, PolicyConfig
    from plait.training.resume import restore_balancer

    model3, opt3 = build(seed=2)
    found = checkpoint.Checkpointer(root).load(model3, opt3)
    semi = Balancer(model3, opt3, None, PolicyConfig(name="semi"), refresh=2, warmup=0)
    fresh = semi.state_dict()
    afresh = restore_balancer(SimpleNamespace(balancer=semi, mesh=None, model=model3), found)
    unchanged = _tensors_differ(semi.state_dict(), fresh)

    model2, opt2, bal2 = _balanced(seed=1)  # even plans, other weights, fresh readings
    found = checkpoint.Checkpointer(root).load(model2, opt2)
    moved = bal2.load_state_dict(found.rank_state["balancer"])
    restored = _tensors_differ(bal2.state_dict(), saved)
    resumed = _steps(model2, opt2, bal2, data[5:], 5)
    return (moved, list(model2.blocks[0].attn.qkv.plan.sizes), restored, go_on, resumed,
            _tensors_differ(bal2.state_dict()["dims"], after["dims"]),
            [layer["keep"] for layer in after["dims"]["blocks.1.mlp"]["layers"]],
            afresh, unchanged, list(model3.blocks[0].attn.qkv.plan.sizes))


def test_balancer_state_round_trips_and_moves_back_to_its_plans(tmp_path):
    for r, out in enumerate(run_ranks(_round_trip, 2, str(tmp_path / "ckpt"))):
        moved, plan, restored, go_on, resumed, later, keeps, afresh, unchanged, plan3 = out
        assert afresh == ("the balancer starts afresh: its state was saved for (policy, tp "
                          "ranks, replicas) ('even', 2, 1), this run has ('semi', 2, 1)"), afresh
        assert (unchanged, plan3) == ([], [5, 5]), r
        assert (moved, plan) == (["blocks.0.attn"], [7, 3]), r  # migrated back to its plan
        assert keeps == ([1.0, 1.0] if r == 0 else [0.5, 0.5]), r  # rank 1 resized
        assert restored == [], (r, restored)
        assert resumed == go_on, r  # bit for bit
        # the scores refreshed after the resume, from the restored snapshot, are the same
        assert later == [], (r, later)
