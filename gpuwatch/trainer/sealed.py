"""Checkpoint directories a framework wrote (Hugging Face's `checkpoint-N`, torchtitan's `step-N`): sealed, verified.

A framework writes its checkpoint its own way and under its own name; gpuwatch cannot change how.
What it can do is what `save_checkpoint` does for its own: once every writer is done, `seal()`
writes `manifest.json` into the directory (each file's size and crc32 per chunk, the files fsynced,
then the manifest, then the directory), so a later `why_unverified()` tells a complete checkpoint
from a torn one (a file cut short, one missing, one changed) without unpickling anything. A
directory with no manifest, or with a framework's own "incomplete" marker in it, does not verify.

`set_aside_unverified()` renames the newest directories that do not verify out of the framework's
sight (`.unverified-<name>-<pid>`), so the framework's own resume ("the highest-numbered
checkpoint-N") lands on the newest good one; each is logged with its reason.

A framework that writes each checkpoint as one file (Lightning's `.ckpt`) gets the same from
`seal_file()` and `why_unverified_file()`: the manifest lies beside the file, `<name>.manifest.json`.

`commit_sealed()` is the single-writer commit for a survivor whose peer died: it seals a filled
temp dir and renames it to its final name, unless another survivor's verified one got there first.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

from gpuwatch.errors import CheckpointError
from gpuwatch.trainer.checkpoint import (
    CRC32,
    MANIFEST,
    MANIFEST_VERSION,
    _chunks_of_file,
    _fsync_dir,
    _Invalid,
    _read_small,
    _rename_unless_verified,
    _verify_crc32,
    _write_synced,
    verify_checkpoint,
)

log = logging.getLogger("gpuwatch.trainer")

ASIDE_PREFIX = ".unverified-"
FILE_MANIFEST_SUFFIX = ".manifest.json"


def seal(path: str | os.PathLike[str], step: int) -> Path:
    """Write the manifest of the checkpoint directory `path` (of `step`), in place; call it once every writer is done.

    Raises:
        CheckpointError: the directory is empty, or a file could not be read or the manifest written.
    """
    path = Path(path)
    try:
        files = {}
        for member in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
            chunks = _chunks_of_file(member)  # reads and fsyncs it
            name = member.relative_to(path).as_posix()
            files[name] = {"size": sum(c.length for c in chunks), CRC32: [list(c) for c in chunks]}
        if not files:
            raise OSError(f"no files in {path}")
        manifest = {"version": MANIFEST_VERSION, "step": step, "t": time.time(), "state_file": None, "files": files}
        tmp = path / f".{MANIFEST}.tmp-{os.getpid()}"
        _write_synced(tmp, json.dumps(manifest, indent=1).encode())
        os.replace(tmp, path / MANIFEST)
        for sub in [path, *(p for p in path.rglob("*") if p.is_dir())]:
            _fsync_dir(sub)
    except OSError as exc:
        raise CheckpointError(f"cannot seal checkpoint {path}: {exc}") from exc
    return path


def seal_file(path: str | os.PathLike[str], step: int) -> Path:
    """Write the manifest of the one-file checkpoint `path` (of `step`) beside it: `<name>.manifest.json`.

    Raises:
        CheckpointError: the file could not be read or the manifest written.
    """
    path = Path(path)
    try:
        chunks = _chunks_of_file(path)  # reads and fsyncs it
        entry = {"size": sum(c.length for c in chunks), CRC32: [list(c) for c in chunks]}
        manifest = {"version": MANIFEST_VERSION, "step": step, "t": time.time(), "files": {path.name: entry}}
        tmp = path.with_name(f".{path.name}{FILE_MANIFEST_SUFFIX}.tmp-{os.getpid()}")
        _write_synced(tmp, json.dumps(manifest).encode())
        os.replace(tmp, path.with_name(path.name + FILE_MANIFEST_SUFFIX))
        _fsync_dir(path.parent)
    except OSError as exc:
        raise CheckpointError(f"cannot seal checkpoint {path}: {exc}") from exc
    return path


def why_unverified_file(path: str | os.PathLike[str]) -> str | None:
    """Why the one-file checkpoint at `path` does not match its manifest (one line), or None when it does."""
    path = Path(path)
    try:
        try:
            manifest = json.loads(_read_small(path.parent, path.name + FILE_MANIFEST_SUFFIX))
        except _Invalid as exc:
            if str(exc).startswith("missing"):
                return f"no {path.name}{FILE_MANIFEST_SUFFIX}: not sealed (its save did not finish)"
            raise
        except (ValueError, RecursionError) as exc:
            return f"{path.name}{FILE_MANIFEST_SUFFIX} unreadable: {exc}"
        entry = manifest.get("files", {}).get(path.name) if isinstance(manifest, dict) else None
        if not isinstance(entry, dict):
            return f"{path.name}{FILE_MANIFEST_SUFFIX} does not list {path.name}"
        _verify_crc32(path.parent, path.name, entry)
    except _Invalid as exc:
        return str(exc)
    return None


def why_unverified(path: str | os.PathLike[str], markers: Iterable[str] = ()) -> str | None:
    """Why the sealed directory at `path` does not verify (one line), or None when it does; no code runs.

    Args:
        path: the checkpoint directory.
        markers: names of files a framework leaves in a checkpoint it has not finished writing.
    """
    path = Path(path)
    for marker in markers:
        if (path / marker).exists():
            return f"{marker} is there: its writer did not finish"
    reason = verify_checkpoint(path)
    if reason is not None and reason.startswith(f"no {MANIFEST}"):
        return f"no {MANIFEST}: not sealed (its save did not finish, or was not made under gpuwatch)"
    return reason


def step_dirs(directory: str | os.PathLike[str], pattern: str) -> list[tuple[int, Path]]:
    """The directories in `directory` whose name matches `pattern` (one group: the step), newest first."""
    regex = re.compile(pattern)
    found = []
    try:
        entries = list(Path(directory).iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        match = regex.fullmatch(entry.name)
        if match is not None and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def newest_verified(
    directory: str | os.PathLike[str], pattern: str, markers: Iterable[str] = ()
) -> tuple[Path | None, list[tuple[str, str]]]:
    """The newest directory matching `pattern` that verifies, and the newer ones that do not (name, reason)."""
    skipped: list[tuple[str, str]] = []
    markers = tuple(markers)
    for _, path in step_dirs(directory, pattern):
        reason = why_unverified(path, markers)
        if reason is None:
            return path, skipped
        skipped.append((path.name, reason))
    return None, skipped


def set_aside_unverified(
    directory: str | os.PathLike[str], pattern: str, markers: Iterable[str] = ()
) -> list[tuple[str, str]]:
    """Rename the directories newer than the newest verified one out of the framework's sight; what and why.

    Safe to call from every rank at once: a directory another rank already moved is simply gone.
    """
    good, skipped = newest_verified(directory, pattern, markers)
    for name, reason in skipped:
        aside = Path(directory) / f"{ASIDE_PREFIX}{name}-{os.getpid()}"
        try:
            os.rename(Path(directory) / name, aside)
        except FileNotFoundError:
            continue  # another rank set it aside first
        except OSError as exc:
            raise CheckpointError(f"cannot set aside checkpoint {name} in {directory}: {exc}") from exc
        log.warning("skipped checkpoint %s: %s (set aside as %s)", name, reason, aside.name)
    if good is not None and skipped:
        log.warning("resuming from %s, the newest checkpoint that verifies", good.name)
    return skipped


def commit_sealed(temp_dir: str | os.PathLike[str], final: str | os.PathLike[str], step: int) -> Path:
    """Seal a filled temp dir and rename it to `final`, unless a verified checkpoint is there already.

    The single-writer commit of a survivor: any survivor, or several at once, may save the same
    step, with no collective call; rename(2) lets one win, and the others keep its checkpoint.

    Raises:
        CheckpointError: the seal or the rename failed.
    """
    temp_dir, final = Path(temp_dir), Path(final)
    seal(temp_dir, step)
    try:
        _rename_unless_verified(temp_dir, final)
        _fsync_dir(final.parent)
    except OSError as exc:
        raise CheckpointError(f"cannot commit checkpoint {final}: {exc}") from exc
    return final
