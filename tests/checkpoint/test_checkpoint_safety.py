"""Nothing lost, nothing half-written: verified loads, failed saves, keep-K, async publish.

On 2 ranks (one launch for the refusals, the failed saves and the asynchronous save; one
in which a rank dies mid-write):

- a flipped byte, a truncated file, a missing shard file, a missing manifest and a
  checkpoint of another model (MLP ratio 2 instead of 4) are refused with one line naming
  the file (or tensor) and what is wrong, the same line on every rank, and the model's
  parameters and optimizer state are bit-identical to before the attempt;
- a full disk (ENOSPC after 4 KiB of a rank's shard file) on one rank fails the save on
  every rank with one line, leaves the previous checkpoint loadable and no ``.tmp-``
  directory; with ``on_error="warn"`` the save returns None and training goes on;
- only the newest ``keep`` checkpoints remain;
- an asynchronous save returns before its (held) write starts and is published only once
  every rank's write has finished;
- a rank killed mid-write leaves the previous checkpoint loadable; the leftover
  ``.tmp-step-N`` is removed by the next load.
"""

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait import checkpoint
from plait.checkpoint import CheckpointError
from plait.models import GPTConfig
from plait.runtime.errors import RankError
from plait.testing import run_ranks

from _ckpt_faults import faulty_writes
from _ckpt_gpt import CFG, build, full, plain_full, rank, same, train

CASES = ("flipped byte", "truncated", "missing shard", "no manifest", "other model")


def _spoil(case: str, step_dir: Path) -> None:
    shard = step_dir / "__1_0.distcp"
    if case == "flipped byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif case == "truncated":
        with open(step_dir / "__0_0.distcp", "r+b") as f:
            f.truncate(f.seek(0, os.SEEK_END) // 2)
    elif case == "missing shard":
        shard.unlink()
    elif case == "no manifest":
        (step_dir / "plait-manifest.json").unlink()


def _refusals(root):
    model, opt = build()
    train(model, opt, 1)
    good = checkpoint.Checkpointer(root).save(1, model, opt, {"k": 1})
    target, topt = build(seed=1)
    train(target, topt, 1)
    before = full(target, topt)
    other = GPTConfig(**{**CFG.__dict__, "mlp_ratio": 2})
    seen = {}
    for case in CASES:
        bad = Path(root) / case.replace(" ", "-") / "step-1"
        if rank() == 0:
            shutil.copytree(good, bad)
            _spoil(case, bad)
        dist.barrier()
        into, into_opt = (target, topt) if case != "other model" else build(seed=1, cfg=other)
        try:
            checkpoint.Checkpointer(bad.parent).load(into, into_opt, path=bad)
            seen[case] = None
        except CheckpointError as err:
            seen[case] = str(err)
        seen[case + ": changed"] = same(full(target, topt), before)
    return seen


def _two_rank_cases(root):
    return {"refusals": _refusals(f"{root}/refusals"), "saves": _failed_saves(f"{root}/run")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank launch for the refusals and the failed and asynchronous saves."""
    root = tmp_path_factory.mktemp("two-ranks")
    return root, run_ranks(_two_rank_cases, 2, str(root))


def test_a_bad_checkpoint_is_refused_on_every_rank_before_anything_changes(two_ranks):
    ranks = [r["refusals"] for r in two_ranks[1]]
    assert ranks[0] == ranks[1]  # the same line on every rank
    seen = ranks[0]
    want = {"flipped byte": ("__1_0.distcp", "checksum mismatch"),
            "truncated": ("__0_0.distcp", "truncated"),
            "missing shard": ("__1_0.distcp", "missing"),
            "no manifest": ("plait-manifest.json", "missing"),
            "other model": ("a different model", "'blocks.0.mlp.fc.bias' is [160] in it, [80]")}
    for case, words in want.items():
        line = seen[case]
        assert line is not None and "\n" not in line, (case, line)
        assert line.startswith("refusing to load ") and all(w in line for w in words), line
        assert seen[case + ": changed"] == [], case


def _failed_saves(root):
    model, opt = build()
    train(model, opt, 1)
    ckpt = checkpoint.Checkpointer(root, keep=2, timeout_s=60)
    first = ckpt.save(1, model, opt)
    train(model, opt, 1)
    out = {}
    with faulty_writes() if rank() == 1 else _nothing():
        try:
            ckpt.save(2, model, opt)
            out["full disk"] = None
        except CheckpointError as err:
            out["full disk"] = str(err)
    out["after full disk"] = sorted(os.listdir(root))
    warn = checkpoint.Checkpointer(root, keep=2, on_error="warn")
    with faulty_writes() if rank() == 0 else _nothing():
        out["warned"] = warn.save(2, model, opt)
    train(model, opt, 1)  # training goes on
    for step in (3, 4):
        ckpt.save(step, model, opt)
    out["kept"] = sorted(os.listdir(root))
    out["first"] = str(first)
    # asynchronous: rank 1's shard file is held until rank 0 opens the gate, which it does
    # once rank 1's save has returned and it has looked at what is published (each waits
    # _HOLD_S at most: a save that does not return ends as a failed check, not a hang)
    gate, returned = Path(root).parent / "gate", Path(root).parent / "returned"
    with faulty_writes(gate=str(gate)) if rank() == 1 else _nothing():
        ckpt.save(5, model, opt, {"at": 5}, blocking=False)
        if rank() == 1:
            out["returned before its write"] = not gate.exists()
            returned.touch()
        else:
            _wait_for(returned)
            out["latest while writing"] = str(ckpt.latest())
            gate.touch()
        out["waited"] = str(ckpt.wait())
    out["latest after wait"] = str(ckpt.latest())
    out["saved"] = full(model, opt)
    return out


_HOLD_S = 60.0  # under the gate's own limit (_ckpt_faults.GATE_LIMIT_S)


def _wait_for(path: Path) -> None:
    end = time.monotonic() + _HOLD_S
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.01)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_failed_save_keeps_the_previous_checkpoint_and_async_publishes_when_written(two_ranks):
    root = two_ranks[0] / "run"
    ranks = [r["saves"] for r in two_ranks[1]]
    out = ranks[0]
    for r in ranks:
        line = r["full disk"]
        assert line is not None and "\n" not in line, line
        assert "checkpoint step 2 was not saved" in line and "rank 1: OSError" in line
        assert "No space left on device" in line and line.endswith("step-1 is intact"), line
        assert r["warned"] is None
    assert out["after full disk"] == ["step-1"]  # the partial .tmp-step-2 is gone
    assert out["kept"] == ["step-3", "step-4"]
    assert ranks[1]["returned before its write"]
    assert out["latest while writing"].endswith("step-4")  # rank 1's write was still held
    assert all(r["waited"].endswith("step-5") and r["latest after wait"].endswith("step-5")
               for r in ranks), ranks
    model, opt = build(seed=1)
    found = checkpoint.load(root, model, opt)
    assert found.step == 5 and found.extra_state == {"at": 5}
    assert same(plain_full(model, opt), out["saved"]) == []


def _killed_mid_save(root):
    model, opt = build()
    train(model, opt, 1)
    ckpt = checkpoint.Checkpointer(root, timeout_s=5)
    ckpt.save(1, model, opt)
    saved = full(model, opt)
    if rank() == 0:
        torch.save(saved, Path(root) / "saved.pt")
    train(model, opt, 1)
    with faulty_writes(crash=True) if rank() == 1 else _nothing():
        ckpt.save(2, model, opt)  # rank 1 dies in its write; rank 0 times out
    return "survived"


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "run"
    with pytest.raises(RankError):
        run_ranks(_killed_mid_save, 2, str(root), timeout_s=10)
    saved = torch.load(root / "saved.pt")
    os.unlink(root / "saved.pt")
    assert sorted(os.listdir(root)) == [".tmp-step-2", "step-1"]
    assert checkpoint.latest(root).name == "step-1"
    model, opt = build(seed=1)
    found = checkpoint.load(root, model, opt)  # one process: the plain GPT
    assert found.step == 1 and same(plain_full(model, opt), saved) == []
    assert sorted(os.listdir(root)) == ["step-1"]
