"""Training models: the one training loop and what commands build around it (decoding and
serving are :mod:`plait.inference`).

- :mod:`~plait.training.loop`: :class:`Trainer`, one optimizer step with components around
  it (:mod:`~plait.training.components`: straggler emulation, balancer, checkpoints,
  progress; :mod:`~plait.training.tally`: the step tally). Every command that trains runs it.
- ``plait train``: :mod:`~plait.training.config` (``TrainConfig``),
  :mod:`~plait.training.models` (build, loss, evaluation), :mod:`~plait.training.data`
  (a corpus and a click log that need no download), :mod:`~plait.training.hf` (transformers
  models), :mod:`~plait.training.dp_tp` (``--dp``/``--tp``, ``--balance``),
  :mod:`~plait.training.resume` (checkpoints), :mod:`~plait.training.report` (``log.json``,
  the capacity ideal) and :mod:`~plait.training.run` (``train``).
"""

__all__ = ["Trainer", "TrainConfig", "train"]


def __getattr__(name: str):
    # torch loads on first use: ``import plait.training.data`` stays light
    if name == "Trainer":
        from .loop import Trainer

        return Trainer
    if name == "TrainConfig":
        from .config import TrainConfig

        return TrainConfig
    if name == "train":
        from .run import train

        return train
    raise AttributeError(f"module 'plait.training' has no attribute {name!r}")
