"""Process groups, launch, the emulated cluster, slow ranks (:mod:`.slow`), errors.

Names load on first use (PEP 562), so the command line parses flags without importing
torch: ``plait.runtime.cluster`` or ``.slow.straggler`` alone costs no torch import.
"""

from .lazy import exports

_WHERE = {
    "cluster": ("EmulatedCluster", "Host", "cluster_support", "format_rate", "max_hosts",
                "parse_rate"),
    "context": ("RankContext", "rank_context"),
    "dist": ("Topology", "default_backend", "init_explicit", "init_from_env", "shutdown",
             "topology"),
    "errors": ("RankError",),
    "launch": ("launch",),
    "slow.straggler": ("SlowSpec", "Straggler", "parse_slow", "validate_slow"),
}
__getattr__, __all__ = exports(__name__, _WHERE)
