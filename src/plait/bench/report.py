"""What every benchmark hands the user: a rich table, a JSON file, a PNG plot, a progress bar."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..runtime.records import machine_meta, write_json

__all__ = ["console", "make_table", "print_table", "print_summary", "summary_text",
           "write_json", "progress_bar", "human_bytes", "machine_meta", "counted"]

# Piped output (CI logs, `| tee`) gets 120 columns instead of rich's 80, so tables stay whole.
console = Console(width=None if sys.stdout.isatty() else 120)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def counted(n: int, word: str) -> str:
    """``1 rank``, ``2 ranks``: a count and its noun, in the number it takes."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


_FOLDED = 4  # characters a label keeps a line when labels fold


def make_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
               caption: str | None = None, labels: int = 1, width: int = 120) -> tuple[Table, int]:
    """The table for a console ``width`` columns wide, and the width it needs.

    The first ``labels`` columns are labels, the others hold figures. A figure is never
    wrapped or shortened with an ellipsis (a ``19195…`` reads as a number it is not): each
    figure column is as wide as its widest cell. Where that does not fit, the table loses its
    rules first, then its labels fold onto more lines; where even the figures alone do not
    fit, the width it needs is more than ``width``.
    """
    cells = [[str(v) for v in row] for row in rows]

    def widest(i: int, words: bool) -> int:
        texts = [Text.from_markup(row[i]).plain for row in cells if i < len(row)] + [columns[i]]
        if words:  # a label wraps between words
            texts = [w for t in texts for w in t.split()] or [""]
        return max(Text(t).cell_len for t in texts)

    least = [widest(i, words=i < labels) + 2 for i in range(len(columns))]  # + padding
    rules = len(columns) + 1
    boxed = sum(least) + rules <= width
    fold = not boxed and sum(least) > width
    table = Table(title=title, caption=caption, header_style="bold", caption_justify="left",
                  **({} if boxed else {"box": None}))
    for i, col in enumerate(columns):
        if i < labels:
            table.add_column(col, justify="left", overflow="fold",
                             min_width=min(least[i] - 2, _FOLDED) if fold else least[i] - 2)
        else:
            table.add_column(col, justify="right", no_wrap=True, overflow="fold",
                             min_width=least[i] - 2)
    for row in cells:
        table.add_row(*row)
    if fold:
        least[:labels] = [min(n, _FOLDED + 2) for n in least[:labels]]
    need = sum(least) + (rules if boxed else 0)
    return table, need


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                caption: str | None = None, labels: int = 1, to: Console | None = None) -> None:
    """Print a table whose figures are never cut: in a terminal too narrow even for the
    figures alone, it is printed wider than the terminal (which then wraps its lines)."""
    to = to or console
    # piped (a log, `| tee`): no terminal wraps the lines, so the table takes the width it
    # needs whole, rather than folding its labels into four-letter pieces
    fit = to.width if to.is_terminal else max(to.width, 10_000)
    table, need = make_table(title, columns, rows, caption, labels, width=fit)
    width = to.width
    try:
        to.width = max(width, need)  # rich would crop at its width: widen it for this table
        to.print(table)
    finally:
        to.width = width


def summary_text(value: Any, fmt: str = ".4g") -> str:
    """A summary figure as a person reads it: a float by ``fmt``, a list as its items
    (a nested one in brackets), a mapping as ``key value`` pairs; no Python quotes."""
    if isinstance(value, float):
        return format(value, fmt)
    if isinstance(value, dict):
        return ", ".join(f"{key} {summary_text(item, fmt)}" for key, item in value.items())
    if isinstance(value, (list, tuple)):
        if not value:
            return "none"
        return ", ".join(f"[{summary_text(item, fmt)}]" if isinstance(item, (list, tuple))
                         else summary_text(item, fmt) for item in value)
    return str(value)


def print_summary(summary: dict, fmt: str = ".4g", to: Console | None = None) -> None:
    """One ``key: value`` line per figure of a benchmark's summary (:func:`summary_text`)."""
    to = to or console
    for key, value in summary.items():
        to.print(f"  {key}: {summary_text(value, fmt)}", markup=False)


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[Any]:
    """A rich progress bar; yields ``advance(n=1, note=None)``."""
    if not enabled:
        yield lambda n=1, note=None: None
        return
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[note]}"),
                        console=console, transient=False)
    with progress:
        task = progress.add_task(description, total=total, note="")

        def advance(n: int = 1, note: str | None = None) -> None:
            progress.update(task, advance=n, note=note or "")
        yield advance
