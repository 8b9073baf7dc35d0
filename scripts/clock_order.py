#!/usr/bin/env python3
"""Where the kernel's CPU throttling lands against a timed region, by the order of the clocks.

One thread in a cgroup held to ``--cores`` of a core (root; cgroup v1 or v2) runs 60 steps:
``n`` small matmuls in a timed region, then optionally a wait during which another thread
of the process spins (as gloo's socket loop polls while a transfer waits). The region's CPU
time over its wall time is printed beside the thread's share of the time it was runnable
(CPU time over CPU time plus runnable wait, the kernel's ``/proc/thread-self/schedstat``),
with the region's end read in two orders:

- ``wall-first``: the wall clock, then the thread's CPU clock (what the speed monitor's
  ``LayerTimer`` did before 98fd0d3);
- ``cpu-first``: the CPU clock, then the wall clock (what it does now).

Reading the CPU clock is a system call that settles the thread's accounting, and the kernel
throttles a thread that has used its quota there; read after the wall clock, the wait falls
outside the region. Each case runs in its own process, in turns. The cgroup is removed at
the end, and its name (``plait-<pid>x<hex>-clock``) lets ``plait cluster clean`` remove it
after a killed run.

    sudo .venv/bin/python scripts/clock_order.py [--cores 0.5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from plait.runtime.slow.cgroup import (cpu_controller, make_cgroup, remove_cgroup,  # noqa: E402
                                  thread_sched)

CASES = [(20, 0.0), (20, 3.0), (20, 6.0), (5, 0.0), (5, 3.0)]  # (matmuls, spin ms)


def child(n: int, spin_ms: float, order: str, steps: int = 60) -> dict:
    """Run in the cgroup: the region's CPU over wall time and the thread's runnable share."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(192, 192)
    go, done = threading.Event(), threading.Event()

    def poller():
        while True:
            go.wait()
            go.clear()
            start = time.perf_counter()
            while time.perf_counter() - start < spin_ms / 1e3:
                pass
            done.set()

    threading.Thread(target=poller, daemon=True).start()
    wall = cpu = 0.0
    first = thread_sched()
    for _ in range(steps):
        cpu0 = time.thread_time()
        wall0 = time.perf_counter()
        for _ in range(n):
            a @ a
        if order == "cpu-first":
            cpu += time.thread_time() - cpu0
            wall += time.perf_counter() - wall0
        else:
            wall += time.perf_counter() - wall0
            cpu += time.thread_time() - cpu0
        if spin_ms > 0:
            go.set()
            done.wait()
            done.clear()
    last = thread_sched()
    got, waited = last[0] - first[0], last[1] - first[1]
    return {"region": cpu / wall, "thread": got / (got + waited)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cores", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, n, spin, order = args.child
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        print(json.dumps(child(int(n), float(spin), order)))
        return 0
    controller = cpu_controller()
    if controller is None or os.geteuid() != 0:
        print("clock_order: needs root and a cgroup cpu controller", file=sys.stderr)
        return 2
    path = make_cgroup(controller, f"plait-{os.getpid()}x{secrets.token_hex(2)}-clock",
                       args.cores)
    rows: dict = {}
    try:
        for _ in range(args.rounds):
            for n, spin in CASES:
                for order in ("wall-first", "cpu-first"):
                    out = subprocess.run([sys.executable, __file__, "--child", path, str(n),
                                          str(spin), order], capture_output=True, text=True,
                                         check=True, timeout=120)
                    rows.setdefault((n, spin), []).append((order, json.loads(out.stdout)))
    finally:
        remove_cgroup(path)
    print(f"one thread at {args.cores} of a core: region CPU / wall time, by the order of "
          f"the clocks at its end; the thread's share of its runnable time (schedstat)")
    print("| a step | region, wall clock read first | region, CPU clock read first | "
          "the thread's share |")
    print("|---|---|---|---|")
    for (n, spin), runs in rows.items():
        def fmt(order):
            return ", ".join(f"{r['region']:.2f}" for o, r in runs if o == order)
        share = [r["thread"] for _, r in runs]
        what = f"{n} matmuls" + (f", then {spin:g} ms while another thread spins" if spin else "")
        print(f"| {what} | {fmt('wall-first')} | {fmt('cpu-first')} | "
              f"{min(share):.2f}–{max(share):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
