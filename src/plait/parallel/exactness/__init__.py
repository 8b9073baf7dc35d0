"""The exactness dry run: before ``parallelize`` changes a weight, every rank's share of each
module the plan touches is simulated on this process, in float64, against the module's own
forward and backward; what cannot run exactly is refused in one line naming the module.

- :mod:`.probe`: the whole model run once on example ids, each module's inputs kept, and
  every embedding, linear, split attention or MLP and expert layer checked (``verify``);
- :mod:`.split`: one split attention or MLP, rank by rank (``check_dim``);
- :mod:`.verdict`: what the run decides (:class:`Verdict`) and the comparisons both share.
"""

from .probe import verify
from .verdict import Refused, Verdict

__all__ = ["Refused", "Verdict", "verify"]
