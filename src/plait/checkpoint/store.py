"""The checkpoint directory: names, the manifest, checksums, atomic publication, pruning.

::

    DIR/step-7/              a published checkpoint: DCP's files and plait-manifest.json
    DIR/.tmp-step-8/         being written (or left by a crash: removed at the next save/load)

A checkpoint is written into ``.tmp-step-N``; once every rank has written its part,
rank 0 hashes every file into the manifest and publishes the directory with one
``os.rename`` to ``step-N``. A directory without a manifest is never a checkpoint.
Pure file work: no torch.distributed here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST", "FORMAT", "step_dirs", "latest", "tmp_dir", "final_dir", "clear_tmp",
           "publish", "prune", "read_manifest", "file_problems", "model_problems"]

MANIFEST = "plait-manifest.json"
FORMAT = "plait-checkpoint/1"
_STEP = re.compile(r"^step-(\d+)$")


def step_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every published checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), root / name) for name in os.listdir(root)
             if (m := _STEP.match(name)) and (root / name / MANIFEST).is_file()]
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest published checkpoint under ``root`` (a ``step-N`` with a manifest), or None."""
    found = step_dirs(root)
    return found[-1][1] if found else None


def tmp_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f".tmp-step-{step}"


def final_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step}"


def clear_tmp(root: str | os.PathLike) -> list[str]:
    """Remove what an unfinished save left (``.tmp-*``); the names removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    gone = sorted(n for n in os.listdir(root) if n.startswith(".tmp-"))
    for name in gone:
        shutil.rmtree(root / name, ignore_errors=True)
    return gone


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Hash every file of ``tmp`` into ``manifest``, write it, and rename ``tmp`` to ``final``.

    An existing ``final`` (the same step saved again) is moved aside first and removed
    after; a crash in between leaves it as a ``.tmp-`` directory, cleared later."""
    files = {}
    for name in sorted(os.listdir(tmp)):
        path = tmp / name
        if path.is_file() and name != MANIFEST:
            files[name] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
    manifest = dict(manifest, files=files)
    staging = tmp / (MANIFEST + ".part")
    with open(staging, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, tmp / MANIFEST)
    _fsync_dir(tmp)
    aside = None
    if final.exists():
        aside = final.parent / f".tmp-replaced-{final.name}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` checkpoints; the paths removed."""
    found = step_dirs(root)
    gone = [path for _, path in found[:max(0, len(found) - keep)]]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def read_manifest(path: str | os.PathLike) -> tuple[dict | None, str | None]:
    """``(manifest, None)``, or ``(None, why it cannot be read)``."""
    file = Path(path) / MANIFEST
    if not Path(path).is_dir():
        return None, f"{path}: no such checkpoint directory"
    if not file.is_file():
        return None, f"{file}: missing (not a published plait checkpoint)"
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        return None, f"{file}: unreadable ({type(err).__name__}: {err})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        return None, f"{file}: format {got!r}, expected {FORMAT!r}"
    return manifest, None


def file_problems(path: str | os.PathLike, manifest: dict, share: tuple[int, int] = (0, 1)
                  ) -> list[str]:
    """What is wrong with the files of ``manifest`` that fall to ``share`` = (rank, world)
    (every world-th file from the rank-th): missing, truncated or grown, changed."""
    path = Path(path)
    rank, world = share
    out = []
    for i, (name, want) in enumerate(sorted(manifest["files"].items())):
        if i % world != rank:
            continue
        file = path / name
        if not file.is_file():
            out.append(f"{file}: missing (a shard file the manifest lists)")
            continue
        size = file.stat().st_size
        if size != want["bytes"]:
            what = "truncated" if size < want["bytes"] else "longer than written"
            out.append(f"{file}: {what} ({size} bytes, {want['bytes']} written)")
        elif _sha256(file) != want["sha256"]:
            out.append(f"{file}: checksum mismatch (sha256 differs from the manifest's: "
                       "the file changed after it was written)")
    return out


def model_problems(path: str | os.PathLike, manifest: dict,
                   shapes: dict[str, list[int]]) -> list[str]:
    """How the model saved in ``manifest`` differs from one whose tensors are ``shapes``
    (names and full shapes): the first difference, as one line."""
    saved = {k: v["shape"] for k, v in manifest["params"].items()}
    where = f"{path}: a different model"
    missing = sorted(set(shapes) - set(saved))
    extra = sorted(set(saved) - set(shapes))
    if missing:
        return [f"{where}: {len(missing)} of this model's tensors are not in it, first "
                f"{missing[0]!r}"]
    if extra:
        return [f"{where}: it holds {len(extra)} tensors this model lacks, first {extra[0]!r}"]
    for name in sorted(shapes):
        if list(saved[name]) != list(shapes[name]):
            return [f"{where}: {name!r} is {list(saved[name])} in it, {list(shapes[name])} here"]
    return []
