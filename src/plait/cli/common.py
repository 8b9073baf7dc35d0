"""Flags every distributed command shares: where to run and what to write, each refused
where it is parsed or before any work starts, never after."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from ..runtime.placement import HOST_CPU_ENV
from ..runtime import max_hosts, parse_rate, parse_slow, validate_slow
from ..runtime.slow.cgroup import parse_budgets, parse_host_cpu

__all__ = ["add_launch_args", "add_output_args", "resolve_placement", "placement_of_many", "transports", "check_shm", "finite_float",
           "positive_int", "non_negative_int", "positive_float", "non_negative_float",
           "port_number", "check_writable", "check_outputs", "check_readable", "max_ranks",
           "remove_empty_folders"]

DEFAULT_DEADLINE_S = 3600.0


def _number(text: str, kind: type, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def finite_float(text: str) -> float:
    return _number(text, float, "a finite number")


def _at_least(kind: type, what: str, low: float, *, above: bool = False):
    """An argparse type: a ``kind`` number of at least ``low`` (above it, with ``above``)."""
    def parse(text: str):
        value = _number(text, kind, what)
        if value < low or (above and value == low):
            need = f"above {low:g}" if above else "at least 1" if low == 1 else "0 or more"
            raise argparse.ArgumentTypeError(
                f"must be {need}, got {value:g}" if kind is float else f"must be {need}, got {value}")
        return value
    return parse


positive_int = _at_least(int, "a whole number", 1)
non_negative_int = _at_least(int, "a whole number", 0)
positive_float = _at_least(float, "a finite number", 0, above=True)
non_negative_float = _at_least(float, "a finite number", 0)


def port_number(text: str) -> int:
    value = _number(text, int, "a port number")
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535, got {value}")
    return value


def max_ranks() -> int:
    """Rank processes this machine runs at most: beyond 16 a core the run measures the
    scheduler (the same bound as runtime.cluster.max_hosts, without the /24's cap)."""
    return 16 * (os.cpu_count() or 1)


def add_launch_args(parser: argparse.ArgumentParser, ranks: int = 2,
                    deadline_s: float = DEFAULT_DEADLINE_S) -> None:
    group = parser.add_argument_group("where it runs")
    group.add_argument("--ranks", type=positive_int, default=None,
                       help=f"number of ranks (default: --hosts, else {ranks})")
    group.add_argument("--hosts", type=non_negative_int, default=0,
                       help="emulated hosts, each a network namespace (default 0: loopback)")
    group.add_argument("--link", default=None,
                       help="each host's link rate, shaped with tc tbf, e.g. 100mbit, 1gbit "
                            "(default 1gbit when --hosts is given; given without --hosts, "
                            "every rank gets a host of its own)")
    group.add_argument("--host-cpu", default=None, metavar="CORES[,CORES…]",
                       help="each host's CPU budget in cores, enforced by the kernel (cgroup "
                            "cpu quota), e.g. 1,0.5: host 1 gets half a core; one number for "
                            "every host (needs --hosts; default: no budget)")
    group.add_argument("--timeout", type=positive_float, default=None,
                       help="seconds before any collective gives up (default 60)")
    group.add_argument("--transport", default=None, metavar="auto|shm|gloo",
                       help="how ranks exchange bytes: shm (shared memory; every rank of a group "
                            "on one host), gloo (torch.distributed), auto (shm where a group "
                            "shares a host, else gloo; the default, or PLAIT_TRANSPORT); the "
                            "benchmarks take a comma list and run each, interleaved")
    group.add_argument("--deadline", type=non_negative_float, default=deadline_s, metavar="SECONDS",
                       help=f"stop every rank if the run takes longer (default {deadline_s:g}; "
                            "0: no deadline)")
    parser.set_defaults(default_ranks=ranks)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--quick", action="store_true", help="a small sweep that finishes fast")
    group.add_argument("--json", metavar="PATH", default=None, help="write the records as JSON")
    group.add_argument("--plot", metavar="PATH", default=None, help="write a PNG plot")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def transports(args: argparse.Namespace, many: bool = False) -> tuple[str, ...]:
    """``--transport`` as a tuple (a comma list only where ``many``), checked; one value is
    also set as PLAIT_TRANSPORT, which the launcher hands every rank."""
    from ..transport.asked import ENV, TRANSPORTS, wanted

    given = getattr(args, "transport", None)
    if given is None:
        return (wanted(),)  # PLAIT_TRANSPORT, refused here, not on every rank once they start
    names = tuple(t.strip() for t in given.split(",") if t.strip())
    bad = [t for t in names if t not in TRANSPORTS]
    if bad or not names:
        raise ValueError(f"--transport {given}: choose from {', '.join(TRANSPORTS)}")
    if len(names) > 1 and not many:
        raise ValueError(f"--transport {given}: this command runs one transport (the "
                         "benchmarks take a comma list)")
    if len(names) == 1:
        os.environ[ENV] = names[0]
    return names


def resolve_placement(args: argparse.Namespace) -> tuple[int, int, str | None]:
    """(ranks, hosts, link) from the flags, refused with a clear error before anything starts."""
    hosts = args.hosts
    if hosts < 0:
        raise ValueError(f"--hosts must be 0 (loopback) or more, got {hosts}")
    if args.link is not None and hosts == 0:
        hosts = args.ranks or args.default_ranks  # a link rate asks for an emulated cluster
    if hosts > max_hosts():
        raise ValueError(f"--hosts {hosts} is more than this machine can make: at most "
                         f"{max_hosts()} ({os.cpu_count()} cores × 16 rank processes, one /24)")
    ranks = args.ranks if args.ranks is not None else (hosts or args.default_ranks)
    if ranks < 1:
        raise ValueError(f"world size (--ranks) must be at least 1, got {ranks}")
    if ranks > max_ranks():
        raise ValueError(f"--ranks {ranks} is more than this machine runs: at most {max_ranks()} "
                         f"({os.cpu_count()} cores × 16 rank processes)")
    link = args.link or ("1gbit" if hosts else None)
    parse_rate(link)
    transports(args)
    if hosts and ranks % hosts:
        raise ValueError(f"--ranks {ranks} does not divide over --hosts {hosts}")
    check_shm(args, ranks, hosts)
    _check_checks()
    if getattr(args, "slow", None):
        args.slow_specs = [parse_slow(s) for s in args.slow]
        validate_slow(args.slow_specs, ranks)
    args.host_cpu_budgets = _host_cpu(getattr(args, "host_cpu", None), hosts)
    return ranks, hosts, link


def check_shm(args: argparse.Namespace, ranks: int, hosts: int) -> None:
    """``--transport shm`` (alone or in a list) on one rank, or where every rank has a host
    of its own: the ranks would each refuse it once started; refused here instead."""
    from ..transport.asked import wanted

    given = getattr(args, "transport", None) or wanted()
    if "shm" not in [t.strip() for t in given.split(",")]:
        return
    if ranks == 1:
        raise ValueError("--transport shm: one rank has nothing to move; shared memory needs "
                         "two or more ranks on a host")
    if hosts and ranks <= hosts:
        raise ValueError(f"--transport shm: each of the {ranks} ranks is on a host of its own "
                         f"(--hosts {hosts}); shared memory needs two or more on a host")
    _check_shm_room(ranks, hosts)



def placement_of_many(args: argparse.Namespace):
    """resolve_placement for a comma list of transports (none of them set for the ranks:
    the benchmark makes each itself)."""
    given, args.transport = args.transport, None
    try:
        ranks, hosts, link = resolve_placement(args)
    finally:
        args.transport = given
    check_shm(args, ranks, hosts)
    return ranks, hosts, link

def _check_shm_room(ranks: int, hosts: int) -> None:
    """``/dev/shm`` must hold every rank's segment (the emulated hosts of this machine share
    it): refused here, naming its size, where the ranks would refuse it once started."""
    from ..transport.collectives import default_capacity
    from ..transport.shm import SHM_DIR, segment_bytes, shm_free_bytes

    per_host = ranks // hosts if hosts else ranks
    need = ranks * segment_bytes(per_host, default_capacity(per_host))
    free = shm_free_bytes()
    if free is not None and free < need:
        raise ValueError(f"--transport shm: {SHM_DIR} has {free / 2**20:.2f} MiB free, "
                         f"{ranks} ranks need {need / 2**20:.2f} MiB: give it more (docker "
                         f"--shm-size, or --ipc=host) or use --transport gloo")


def _check_checks() -> None:
    """PLAIT_CHECKS, refused here (before any rank starts) where the ranks would refuse it."""
    from ..transport.asked import checks_from_env

    checks_from_env()


def _host_cpu(text: str | None, hosts: int) -> list[float] | None:
    """--host-cpu as cores per host, or None; handed to runtime.placement.run_placed through
    PLAIT_HOST_CPU (set, or cleared, on every call: one command's budget never leaks into
    the next command run in the same process)."""
    os.environ.pop(HOST_CPU_ENV, None)
    if text is None:
        return None
    if not hosts:
        raise ValueError(f"--host-cpu {text} needs --hosts N: a CPU budget is per emulated host")
    try:
        budgets = parse_budgets(parse_host_cpu(text), hosts)
    except ValueError as exc:
        raise ValueError(f"--host-cpu {text}: {exc}") from None
    os.environ[HOST_CPU_ENV] = ",".join(f"{b:g}" for b in budgets)
    return budgets


def check_writable(path: str | os.PathLike | None, flag: str, *,
                   directory: bool = False) -> list[Path]:
    """Refuse an output path that cannot be written, before the work that fills it starts.

    Makes the missing parent folders (``path`` itself too when ``directory``), writes and
    removes a temporary file there; on failure removes what it made and raises ValueError
    naming the flag and the path. Returns the folders it made; None passes (not asked for).
    """
    if path is None:
        return []
    path = Path(path)
    folder = path if directory else path.parent
    made: list[Path] = []
    try:
        if not directory and path.is_dir():
            raise OSError(f"{path} is a folder; give a file name")
        for parent in reversed((folder, *folder.parents)):
            if parent.exists() and not parent.is_dir():
                raise OSError(f"{parent} is a file, not a folder")
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        if path.exists() and not directory:
            with open(path, "ab"):  # appends nothing: only asks whether it may be replaced
                pass
        else:
            fd, probe = tempfile.mkstemp(prefix=".plait-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        remove_empty_folders(made)
        reason = exc.strerror or str(exc)
        raise ValueError(f"{flag} {path}: cannot write there ({reason})") from None
    return made


def check_outputs(args: argparse.Namespace, *flags: str) -> None:
    """check_writable for each of ``flags`` (file outputs, e.g. "json", "plot") that the user
    gave; when one is refused, the folders made for the others are removed too."""
    made: list[Path] = []
    try:
        for flag in flags:
            made += check_writable(getattr(args, flag, None), f"--{flag.replace('_', '-')}")
    except ValueError:
        remove_empty_folders(made)
        raise


def check_readable(path: str | os.PathLike | None, flag: str) -> None:
    """Refuse an input file that is not there, before any work starts."""
    if path is not None and not Path(path).is_file():
        what = "is a folder, not a file" if Path(path).is_dir() else "no such file"
        raise ValueError(f"{flag} {path}: {what}")


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove ``folders`` (as check_writable made them) where they are still empty."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            pass
