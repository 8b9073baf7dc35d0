"""Slow ranks, made on purpose: every way plait emulates a slower device or host.

- :mod:`.straggler`: a rank ``F`` × slower at compute, by sleeping ``(F − 1)`` × each
  compute piece it times (``--slow RANK:F``, ``--slow-by sleep``), or by its host's CPU
  budget (``--slow-by kernel``);
- :mod:`.cgroup`: the kernel's side: a CPU budget per emulated host (cgroup v1 ``cpu``
  quota; ``--host-cpu``), and a noisy neighbour that competes for it;
- :mod:`.scenario_file`: per-rank slowdowns over a run's steps, written in a JSON file
  and replayed (``--scenario-file``);
- :mod:`.scenarios`: ``bench hetero``'s named scenarios (``straggler-2x``, ``spike``, …).

A rank whose clock moves only by the work it does (the balancer's tests):
:mod:`plait.testing.virtual`.
"""
