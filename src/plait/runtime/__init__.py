"""Process groups, launch, the emulated cluster, straggler emulation, errors."""

from .cluster import EmulatedCluster, Host, cluster_support, format_rate, max_hosts, parse_rate
from .context import RankContext, rank_context
from .dist import Topology, default_backend, init_explicit, init_from_env, shutdown, topology
from .errors import RankError
from .launch import launch
from .straggler import SlowSpec, Straggler, parse_slow, validate_slow

__all__ = [
    "EmulatedCluster", "Host", "cluster_support", "format_rate", "max_hosts", "parse_rate",
    "RankContext", "rank_context",
    "Topology", "default_backend", "init_explicit", "init_from_env", "shutdown", "topology",
    "RankError", "launch",
    "SlowSpec", "Straggler", "parse_slow", "validate_slow",
]
