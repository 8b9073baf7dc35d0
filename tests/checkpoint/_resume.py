"""A run stopped after a checkpoint and resumed, in the same ranks: what the resume tests
compare (helpers for tests/checkpoint, not a test)."""

import shutil
from dataclasses import replace
from pathlib import Path


def killed_then_resumed(cfg, resumed_dir: str, train, every: int, resume_at: int):
    """``train(cfg)`` never stopped, then ``train`` again, everything built anew, resumed from
    a copy of its checkpoints up to ``step-{resume_at}`` (as if killed after it); each rank a
    virtual device (:mod:`plait.testing.virtual`), so the balancer decides alike both times."""
    import torch.distributed as dist

    from plait.testing.virtual import VirtualDevice

    device = VirtualDevice().install()  # in this rank's process only
    with device:
        first = train(cfg)
    if dist.get_rank() == 0:
        resumed = Path(resumed_dir)
        resumed.mkdir()
        for step in range(every, resume_at + 1, every):
            shutil.copytree(Path(cfg.checkpoint_dir) / f"step-{step}", resumed / f"step-{step}")
    dist.barrier()
    with device:
        return first, train(replace(cfg, checkpoint_dir=resumed_dir, resume=True))
