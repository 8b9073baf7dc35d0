"""``plait``: the command line. Thin: it parses flags into config dataclasses and calls the library.

Every expected failure ends in one line on stderr and a non-zero exit status: 2 for a
refused input, 1 for a failed run, 128 + N when signal N stopped it. ``--debug`` (or
PLAIT_DEBUG=1) adds the full traceback, and for a failed rank the traceback on that rank.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import signal
import sys
import traceback

from .commands import COMMANDS, add_commands

__all__ = ["main", "build_parser", "package_version"]


class _Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line (its usage block is one ``--help`` away), which
    matches no flag by a prefix of it (``allow_abbrev=False``), and whose every command takes ``--debug`` and ``-v`` before or after its name (set only
    where given, so one given before the command's name stands)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # a prefix of a flag is no flag
        super().__init__(*args, **kwargs)
        self.set_defaults(_parser=self)  # the innermost command's parser: its refusals
        self.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                          help="plait's debug logging")
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="on a failure, the full traceback (and the failed rank's) after "
                               "the one-line message (also PLAIT_DEBUG=1); a refused argument "
                               "stays one line")

    def error(self, message: str):
        wrong = re.search(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)",
                          message)
        if wrong:  # a mistyped command or choice: the nearest, as for a mistyped flag
            what, given, listed = wrong.groups()
            choices = re.findall(r"'([^']*)'", listed)
            near = difflib.get_close_matches(given, choices, n=1, cutoff=0.6)
            message = (f"{what} {given!r} is not one of {', '.join(choices)}"
                       + (f"; did you mean {near[0]}?" if near else ""))
        self.exit(2, f"plait: error: {message} (see: {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown flag is refused by the command it was given to
        (``see: plait demo --help``), with the nearest flag it has where one is near."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = getattr(parsed, "_parser", self)
            flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
            near = difflib.get_close_matches(extra[0].split("=")[0], flags, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near and extra[0].startswith("-") else ""
            parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return parsed


class Stopped(BaseException):
    """Raised in the main thread by a SIGTERM (or SIGHUP), so ``finally`` and ``with`` blocks
    run and stop what the command started; a BaseException, so ``except Exception`` in the
    library does not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _OnePrefix(logging.Formatter):
    """``plait: message`` for plait's loggers (whose messages often begin with ``plait: ``
    already), ``plait: NAME: message`` for anyone else's."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        while text.startswith("plait: "):
            text = text[len("plait: "):]
        if record.name != "plait" and not record.name.startswith("plait."):
            text = f"{record.name}: {text}"
        return f"plait: {text}"


def package_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("plait")
    except (ImportError, PackageNotFoundError):
        import plait

        return getattr(plait, "__version__", "unknown")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; given ``argv``, only the command it names gets its flags (the
    others are a line in ``--help``), so nothing else is imported."""
    parser = _Parser(
        prog="plait", description="Fused compute–collective operators and heterogeneity-aware "
                                  "tensor parallelism for PyTorch.")
    parser.add_argument("--version", action="version", version=f"plait {package_version()}")
    parser.set_defaults(verbose=False, debug=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub, COMMANDS, argv)
    return parser


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def _explain(exc: BaseException) -> tuple[str, int]:
    """(the one line, the exit status) of an expected failure."""
    from ..runtime.errors import RankError

    if isinstance(exc, RankError):
        hint = (f" (--debug: the traceback on rank {exc.rank})" if exc.remote_traceback
                else " (out of memory? dmesg tells)" if exc.exitcode == -signal.SIGKILL else "")
        return f"{exc.headline()}; the other ranks were stopped{hint}", 1
    if isinstance(exc, (ValueError, TypeError)):  # a user mistake
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, 2
    if isinstance(exc, OSError):
        return (f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror
                else str(exc) or type(exc).__name__), 1
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first} (--debug: the traceback)", 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--version"]:  # answered before the commands import torch (seconds)
        print(f"plait {package_version()}")
        return 0
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as done:  # --help, or a refusal argparse has printed in one line
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    debug = args.debug or os.environ.get("PLAIT_DEBUG", "") not in ("", "0")
    handler = logging.StreamHandler()
    handler.setFormatter(_OnePrefix("%(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    if args.verbose:  # plait's own debug lines, not every library's (matplotlib's fonts)
        logging.getLogger("plait").setLevel(logging.DEBUG)
        from ..runtime.launch import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"  # and every rank's (runtime.launch)
    if getattr(args, "deadline", None) is not None:
        os.environ["PLAIT_DEADLINE_S"] = f"{args.deadline:g}"  # read by runtime.launch
    previous = _catch_stop_signals()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("plait: interrupted; everything it started has been stopped", file=sys.stderr)
        return 130
    except Stopped as stop:
        name = signal.Signals(stop.signum).name
        print(f"plait: stopped by {name}; everything it started has been stopped", file=sys.stderr)
        return 128 + stop.signum
    except (RuntimeError, OSError, ValueError, TypeError) as exc:
        line, status = _explain(exc)
        if debug:
            traceback.print_exc()
        parser = getattr(args, "_parser", None)
        if status == 2 and parser is not None:  # a refused value: where the flags are told
            line += f" (see: {parser.prog} --help)"
        print(f"plait: error: {line}", file=sys.stderr)
        return status
    finally:
        for sig, was in previous.items():
            signal.signal(sig, was)


def _catch_stop_signals() -> dict:
    """SIGTERM and SIGHUP raise Stopped instead of ending the process where it stands (which
    leaves rank processes' namespaces and folders behind); not where they are ignored
    (nohup) or handled already, and only in the main thread. Returns what to restore."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, _raise_stopped)
    return previous
