"""What every benchmark hands the user: a rich table, a JSON file, a PNG plot, a progress bar."""

from __future__ import annotations

import json
import platform
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["console", "print_table", "write_json", "progress_bar", "human_bytes", "machine_meta"]

# Piped output (CI logs, `| tee`) gets 120 columns instead of rich's 80, so tables stay whole.
console = Console(width=None if sys.stdout.isatty() else 120)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                caption: str | None = None) -> None:
    table = Table(title=title, caption=caption, header_style="bold")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*[str(v) for v in row])
    console.print(table)


def machine_meta() -> dict:
    import os

    import torch

    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}


def write_json(path: str | Path, records: list[dict], meta: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {**machine_meta(), **(meta or {})}, "records": records},
                               indent=1))
    return path


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
