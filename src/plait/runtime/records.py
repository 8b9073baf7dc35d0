"""Records on disk: a run's records as JSON, with the machine that made them."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

__all__ = ["machine_meta", "write_json"]


def machine_meta() -> dict:
    """When and where: time, host, CPUs, Python, torch and whether CUDA was there."""
    import torch

    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}


def write_json(path: str | Path, records: list[dict], meta: dict | None = None) -> Path:
    """``{"meta": machine_meta() + meta, "records": records}`` at ``path`` (folders made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {**machine_meta(), **(meta or {})}, "records": records},
                               indent=1))
    return path
