"""Run a function on N local ranks and return each rank's result.

``launch(fn, world_size)`` starts one process per rank (forked from a server
that has already imported torch, so a launch costs ~0.1 s, not an import of
torch per rank), joins them into a gloo group through a file store, runs
``fn(*args, **kwargs)`` on each and returns the results in rank order.

Failure handling is the point of this module:

- an exception on any rank is re-raised in the caller as :class:`RankError`
  naming the rank and carrying its traceback;
- a rank that dies (SIGKILL, segfault, OOM) is named the moment its process
  ends, not after a collective timeout;
- either way the other ranks are stopped at once and no process is left:
  every rank has PR_SET_PDEATHSIG, so even a SIGKILL of the caller takes them
  down;
- every collective carries the group timeout, so a rank never waits forever;
- a watchdog in the launcher (:mod:`plait.runtime.watchdog`) stops a run in
  which no rank has made progress for that timeout plus a grace (a collective
  timeout cannot fire while its thread gets no core), and names the rank that
  stopped answering (a stopped process, or the one furthest behind) and the
  operator it was last in, with its host.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import select
import shutil
import signal
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Sequence

from .slow.cgroup import join_cgroup
from .cluster import EmulatedCluster, Host
from .context import RankContext, _set_rank_context
from .dist import init_explicit, shutdown, _timeout_s
from .errors import (RankError, all_timed_out, describe_exit, host_label, is_secondary,
                     raise_first)
from .leftovers import LAUNCH_DIR_PREFIX, owner_alive, remove_leftovers
from .progress import ProgressBoard
from .slow.straggler import SlowSpec, Straggler, validate_slow
from .watchdog import Watchdog, process_state

VERBOSE_ENV = "PLAIT_VERBOSE"  # set by ``plait -v``: every rank logs plait's debug lines

__all__ = ["launch"]

_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_GRACE_S = 0.5  # after the first failure, how long to listen for the others' reports
# past its collective timeout, how long a rank may take to report that it timed out (an
# exception pickled down a pipe: milliseconds, or seconds on a loaded machine)
_REPORT_S = 5.0


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _enter_netns(name: str) -> None:
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc().setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _rank_main(rank: int, world_size: int, fn: Callable, args: tuple, kwargs: dict,
               store_path: str, host: Host, link: str, backend: str, timeout_s: float,
               threads: int, env: dict, slow: Sequence[SlowSpec], board: ProgressBoard,
               conn, launcher: int) -> None:
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the forkserver's death, not the launcher's
    exit_with(launcher)
    try:
        if host.cgroup is not None:  # the host's CPU budget, before any of fn's work
            join_cgroup(host.cgroup)
        os.environ.update(env)
        # torch.compile's kernels compiled in this process, not a pool of workers: the ranks
        # already fill the cores, and the pool's semaphores outlived it ("leaked semaphore")
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
            _log_debug_to_stderr(rank)
        # every rank of a launch shares this machine's cores, whatever host it emulates
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          PLAIT_RANKS_ON_MACHINE=str(world_size), GLOO_SOCKET_IFNAME=host.ifname,
                          MASTER_ADDR=host.addr)
        if host.netns is not None:
            _enter_netns(host.netns)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world_size)
        try:
            topo = init_explicit(rank=rank, world_size=world_size, backend=backend, store=store,
                                 timeout_s=timeout_s)
        except RuntimeError as exc:
            raise _InitError(str(exc)) from exc
        _set_rank_context(RankContext(topo, host, link, Straggler(slow, rank), _reporter(conn),
                                      board))
        result = fn(*args, **kwargs)
        shutdown()
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        summary = f"raised {type(exc).__name__}: {exc}"
        try:
            payload = pickle.dumps(("err", summary, traceback.format_exc(), exc))
        except Exception:  # an exception that does not pickle still reports its text
            payload = pickle.dumps(("err", summary, traceback.format_exc(), None))
        conn.send_bytes(payload)
    finally:
        conn.close()


def _log_debug_to_stderr(rank: int) -> None:
    """``plait -v`` (PLAIT_VERBOSE): this rank's plait logging, at DEBUG, on stderr, each
    line naming the rank (a balancer's decisions, apply_tp's plan)."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"plait: rank {rank}: %(message)s"))
    logger = logging.getLogger("plait")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False


def exit_with(pid: int) -> None:
    """End this process (a rank, an elastic worker) when ``pid`` (its launcher, its agent)
    ends, however it ends (SIGKILL included).

    A rank's parent is the forkserver, not the launcher, and every rank inherits the write
    end of the forkserver's "alive" pipe, so a SIGKILLed launcher left its ranks (and the
    forkserver) running: a 400-step ``plait train`` went on for a minute after its kill. A
    thread waits on the launcher's pidfd and exits the process when it becomes readable."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # already gone
    except (AttributeError, OSError):  # no pidfd (kernel < 5.3): poll the pid instead
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while owner_alive(pid):
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="plait-launcher-watch", daemon=True).start()


class _InitError(RuntimeError):
    """The group could not be formed (gloo's mesh of TCP connections); the launch may retry."""


def _reporter(conn) -> Callable[[Any], None]:
    def report(payload: Any) -> None:
        conn.send_bytes(pickle.dumps(("progress", payload)))
    return report


_CTX: mp.context.BaseContext | None = None


def _context() -> mp.context.BaseContext:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch._dynamo: every optimizer imports it on construction (3.4 s a rank here, paid
        # by every rank at once); once in the server, the ranks inherit it
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                     "plait.runtime"])
    return _CTX


def launch(fn: Callable[..., Any], world_size: int, *, args: tuple = (), kwargs: dict | None = None,
           cluster: EmulatedCluster | None = None, backend: str = "gloo",
           timeout_s: float | None = None, threads: int | None = None,
           slow: Sequence[SlowSpec] = (), env: dict[str, str] | None = None,
           deadline_s: float | None = None,
           on_progress: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    ``cluster``: an :class:`EmulatedCluster` that is up (ranks are placed on
    its hosts in contiguous blocks); None runs on loopback. ``timeout_s``:
    every collective's timeout (default PLAIT_TIMEOUT_S or 60 s).
    ``threads``: torch threads per rank (default: cores ÷ ranks, at least 1).
    ``slow``: straggler emulation, see :mod:`plait.runtime.slow.straggler`.
    ``deadline_s``: stop everything if the whole run takes longer (default
    PLAIT_DEADLINE_S where set, which the ``plait`` commands set; else none).
    ``on_progress(rank, payload)``: called in the caller for each
    ``rank_context().report(payload)`` a rank makes (progress bars).
    ``fn`` and its arguments must be picklable (a module-level function).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer of at least 1, got {world_size!r}")
    validate_slow(slow, world_size)
    timeout_s = _timeout_s(timeout_s)
    if deadline_s is None and os.environ.get("PLAIT_DEADLINE_S"):
        deadline_s = float(os.environ["PLAIT_DEADLINE_S"]) or None  # 0: none
    if timeout_s <= 0:
        raise ValueError(f"timeout must be positive, got {timeout_s} s")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    if cluster is not None and not cluster.hosts:
        cluster.up()
    hosts = [cluster.host_of_rank(r, world_size) if cluster else Host(0, None, "lo", "127.0.0.1")
             for r in range(world_size)]
    link = cluster.link_label if cluster else "loopback"
    env = {**{k: os.environ[k] for k in (VERBOSE_ENV, "PLAIT_TRANSPORT") if k in os.environ},
           **(env or {})}
    run = (fn, world_size, args, kwargs or {}, hosts, link, backend, timeout_s, threads,
           env, tuple(slow), deadline_s, on_progress)
    try:
        return _launch_once(*run)
    except RankError as err:
        # Forming gloo's mesh of loopback connections fails now and then on a loaded
        # machine ("connectFullMesh ... Connection closed by peer"), before any of fn has
        # run on the failing rank: one fresh attempt, never more, and only for that.
        if "_InitError" not in err.summary:
            raise
        return _launch_once(*run)


def _launch_once(fn, world_size, args, kwargs, hosts, link, backend, timeout_s, threads, env,
                 slow, deadline_s, on_progress) -> list[Any]:
    remove_leftovers()
    ctx = _context()
    workdir = tempfile.mkdtemp(prefix=f"{LAUNCH_DIR_PREFIX}{os.getpid()}-")
    board = ProgressBoard.new(ctx, world_size)
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main, name=f"plait-rank{rank}", daemon=True,
                args=(rank, world_size, fn, args, kwargs, os.path.join(workdir, "store"),
                      hosts[rank], link, backend, timeout_s, threads, env, slow, board,
                      child_conn, os.getpid()))
            proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
        watchdog = Watchdog(board, world_size, timeout_s)
        return _collect(procs, conns, deadline_s, on_progress, watchdog, hosts)
    finally:
        _stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(procs: list, conns: list, deadline_s: float | None,
             on_progress: Callable[[int, Any], None] | None, watchdog: Watchdog,
             hosts: list[Host]) -> list[Any]:
    results: dict[int, Any] = {}
    failures: list[tuple[int, str, str, int | None, BaseException | None]] = []
    pending = set(range(len(procs)))
    pids = {rank: proc.pid for rank, proc in enumerate(procs)}
    start = time.monotonic()
    first_failure_at: float | None = None
    while pending:
        now = time.monotonic()
        if first_failure_at is not None and now - first_failure_at > _GRACE_S and not \
                _may_still_report(failures, pending, watchdog, pids, now - first_failure_at, now):
            break
        if deadline_s is not None and now - start > deadline_s:
            # the deadline, not a hang: name the rank furthest behind and where it was
            rank, _ = watchdog.blame(sorted(pending), pids, now)
            where, quiet = watchdog.board.last_op(rank), watchdog.quiet_s(rank, now)
            state = ", ".join(([f"last in {where}"] if where else [])
                              + ([f"no progress for {quiet:.0f} s"] if quiet >= 1 else []))
            failures.append((rank, f"had not finished{f' ({state})' if state else ''} when "
                                   f"the run passed its {deadline_s:g} s deadline",
                             "", None, None))
            break
        if watchdog.expired(now):
            rank, why = watchdog.blame(sorted(pending), pids, now)
            failures.append((rank, f"{why}; no rank made progress for {watchdog.limit_s:g} s "
                                   f"(the collective timeout + {watchdog.grace_s:g} s), so "
                                   f"every rank was stopped", "", None, None))
            break
        handles = {conns[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
        for handle in wait(list(handles), timeout=0.1):
            rank = handles[handle]
            if rank not in pending:
                continue
            report = _read_report(conns[rank], procs[rank])
            if report is not None and report[0] == "progress":
                if on_progress is not None:
                    on_progress(rank, report[1])
                continue
            if report is None:
                continue  # process still running, the pipe was not yet readable
            pending.discard(rank)
            if report[0] == "ok":
                results[rank] = report[1]
            else:
                failures.append((rank, *report[1:]))
                first_failure_at = first_failure_at or time.monotonic()
    if failures and pending and all(is_secondary(f[1], f[2]) for f in failures):
        # the others gave up waiting (timed out, peer gone) on a rank that never answered
        rank, why = watchdog.blame(sorted(pending), pids, time.monotonic())
        failures.insert(0, (rank, f"{why}; the others timed out waiting for it", "", None, None))
    if failures and not pending and all("Timed out" in f[1] for f in failures):
        failures = all_timed_out(failures, [host_label(h) for h in hosts],
                                 watchdog.board.last_op)
    if failures:
        raise_first(failures, [host_label(h) for h in hosts])
    return [results[r] for r in range(len(procs))]


def _may_still_report(failures: list, pending: set[int], watchdog: Watchdog,
                      pids: dict[int, int | None], since_first: float, now: float) -> bool:
    """Whether to go on listening past the grace: every failure so far is an echo (a
    timeout, a peer gone) and a rank yet to report may still report its own. A rank in a
    collective times out at most the collective timeout after its last progress mark
    (entering a plait operator marks it); a stopped process, or one that never marked, is
    not waited for. With the grace alone, where a link went down and the second rank's
    timeout came over 0.5 s after the first (a loaded machine's lag), it went unheard and
    the run was blamed on that rank ("stopped answering") instead of the link."""
    if since_first > watchdog.timeout_s + _REPORT_S:
        return False
    if not all(is_secondary(f[1], f[2]) for f in failures):
        return False
    return any(watchdog.marked(rank) and process_state(pids[rank]) not in ("T", "t")
               and watchdog.quiet_s(rank, now) < watchdog.timeout_s + _REPORT_S
               for rank in pending)


def _read_report(conn, proc) -> tuple | None:
    """("ok", result), ("progress", payload) or ("err", summary, traceback, exitcode, exception);
    None while the rank runs and has said nothing new."""
    try:
        if conn.poll():
            message = pickle.loads(conn.recv_bytes())
            if message[0] in ("ok", "progress"):
                return message
            _, summary, tb, exc = message
            return ("err", summary, tb, None, exc)
    except (EOFError, OSError):
        pass
    if proc.is_alive():
        if conn.closed or not conn.poll():
            return None
    proc.join(timeout=1.0)
    return ("err", describe_exit(proc.exitcode), "", proc.exitcode, None)


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            if process_state(proc.pid) in ("T", "t"):  # a stopped rank acts on SIGTERM only
                os.kill(proc.pid, signal.SIGCONT)     # once continued
    end = time.monotonic() + 2.0
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)
