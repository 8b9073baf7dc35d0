"""Training that survives losing a host, on PyTorch's elastic agent (torchrun, c10d rendezvous).

    from plait.elastic import ElasticConfig, run_elastic

    result = run_elastic(ElasticConfig(hosts=3, steps=60, kill_host=2, kill_at=20))
    result["recovery_s"], result["steps_lost"], result["heldout_loss"]

:mod:`plait.elastic.worker` is the training entry point torchrun runs on every host;
:mod:`plait.elastic.launcher` starts one agent per emulated host and injects the fault;
:mod:`plait.elastic.report` reads the workers' logs. See ``docs/elastic.md``.
"""

from ..runtime.lazy import exports

_WHERE = {"config": ("ElasticConfig",), "launcher": ("run_elastic", "run_reference"),
          "report": ("read_incarnations", "summarize")}
__getattr__, __all__ = exports(__name__, _WHERE)  # the CLI parses flags without torch
