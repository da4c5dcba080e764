"""Verified checkpoints: one fresh directory per step, a checksummed manifest, an atomic `latest` pointer.

A save writes into `<dir>/.tmp-step-<N>-<pid>/`, fsyncs every file, writes `manifest.json`
(step, and each file's size and checksums), fsyncs the directory, renames it to `<dir>/step-<N:08d>`,
fsyncs `<dir>`, then replaces `<dir>/latest` (a file holding the directory name) the same way.
A crash at any point leaves either the old checkpoint set or the new one, never a half-written
directory under a final name. `load_latest` trusts nothing: it verifies the manifest of what
`latest` names and, when that fails, of each older `step-*` in turn, and says which it skipped.

A state of plain tensors and containers (a state dict) is written as a flat tensor file,
`state.flat` (gpuwatch.trainer.tensorfile): raw tensor bytes in 16 MiB chunks, written with O_DIRECT
by a pool of threads, each chunk's crc32 in the manifest; a load reads and checksums the chunks in
parallel and returns nothing before all match. That runs at the disk's speed where torch.save's
zip writer and a sha256 pass ran at a fraction of it. Anything else (custom objects) still goes
through torch.save (`state.pt`), and a checkpoint written before (manifest version 1, sha256) loads
as it always did.

A checkpoint is data, never code: whoever can write the checkpoint directory must not get to run
code as the job by crafting one. `load_latest` opens every file with O_NOFOLLOW|O_NONBLOCK below
the checkpoint's own directory (no links, no FIFOs, no devices: a regular file or a skip), bounds
every read by the file's size, unpickles only with an allow-list (containers, numbers, strings;
torch.load with weights_only=True), and turns any failure into "skip this checkpoint, try the older
one" with its reason. `allow_code_execution=True` lifts the allow-list, for states of custom objects
and for DCP checkpoints (dcp.load unpickles their `.metadata`): only for checkpoints you trust.

With DDP (torch.distributed initialized), `save_checkpoint` lets rank 0 write the state it
was given and holds every rank at a barrier until the checkpoint is in place; all ranks must call
it. Every rank then loads the same files, so `<dir>` must be on a filesystem they all see.

With torch.distributed.checkpoint (DCP, sharded state written by every rank), let DCP write the
shards into the temporary directory and let rank 0 commit it::

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from gpuwatch.trainer.checkpoint import commit_checkpoint, load_latest, new_temp_dir

    # save: every rank writes its shards into rank 0's temp dir, then rank 0 commits
    name = [str(new_temp_dir(ckpt_dir, step)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    dcp.save(state_dict, checkpoint_id=name[0])  # fsyncs the shards, writes .metadata last
    dist.barrier()
    if dist.get_rank() == 0:
        commit_checkpoint(ckpt_dir, step, name[0])  # manifest + fsync + rename + latest + prune
    dist.barrier()

    # resume: the manifest is verified first; DCP reshards onto the current world size
    loaded = load_latest(ckpt_dir, allow_code_execution=True)  # dcp.load unpickles: a trusted dir only
    if loaded is not None:
        dcp.load(state_dict, checkpoint_id=loaded.path)

torch is imported here only to load a `state.pt`; a program that has not imported torch saves
its state with pickle (`state.pkl`), which loads with or without torch (a state of plain values;
anything else only with `allow_code_execution=True`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import io
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import stat
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from gpuwatch.errors import CheckpointError
from gpuwatch.trainer import tensorfile

log = logging.getLogger("gpuwatch.trainer")

MANIFEST = "manifest.json"
LATEST = "latest"
MANIFEST_VERSION = 2  # 1: sha256 per file; 2: crc32 per 16 MiB chunk ("crc32": [[offset, length, crc], ...])
FLAT_STATE = "state.flat"

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_LEFTOVER_DIR = re.compile(r"^\.(?:tmp|old)-step-(\d+)-\d+(?:-[0-9a-f]+)?$")
_CHUNK = 1 << 20
_MAX_SMALL_FILE = 256 << 20  # manifest.json and `latest`: far above any real one, far below a memory scare
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_latest` found: the step, the state (None for a DCP checkpoint), and what it skipped."""

    step: int
    state: Any
    path: Path
    skipped: list[tuple[str, str]] = field(default_factory=list)


class _Invalid(Exception):
    """A checkpoint does not verify; the message is the reason, as logged."""


def step_dir_name(step: int) -> str:
    """The final directory name of the checkpoint of `step` ("step-00000040")."""
    return f"step-{step:08d}"


def new_temp_dir(directory: str | os.PathLike[str], step: int) -> Path:
    """Create and return the fresh `.tmp-step-<N>-<pid>-<random>` directory a save of `step` writes into.

    Args:
        directory: the checkpoint directory (created when missing).
        step: the training step being saved.

    Raises:
        CheckpointError: the directory could not be created.
    """
    # Unguessable: a name planted in a directory others can write cannot make the save fail.
    path = Path(directory) / f".tmp-step-{step}-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint temp dir {path}: {exc}") from exc
    return path


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    state: Any,
    *,
    rank: int | None = None,
    barrier: Callable[[], object] | None = None,
    keep: int = 3,
    single_writer: bool = False,
) -> Path:
    """Save `state` as the verified checkpoint of `step`; keep the `keep` newest, delete older ones.

    Every rank calls it. Rank 0 writes (torch.save into `state.pt` when the program imported torch,
    else pickle into `state.pkl`); then all ranks meet at the barrier.

    With `single_writer=True` only the caller saves, with no barrier and no rank check: the rescue
    of a data-parallel job whose peer died (`TrainerLink.rescue`), where any survivor, or several at
    once, may save the same step. A checkpoint of `step` that is already in place and verifies is
    kept (another survivor won the rename); one that does not verify is replaced.

    Args:
        directory: the checkpoint directory (created when missing).
        step: the training step the state belongs to.
        state: anything picklable (torch.save handles tensors); ignored on ranks other than 0.
        rank: this rank; default: torch.distributed's rank when it is initialized, else 0.
        barrier: called by every rank after rank 0 is done; default: dist.barrier when initialized.
        keep: how many checkpoints to keep (this one and the newest older ones).
        single_writer: save from this process alone, with no collective call (see above).

    Returns:
        The checkpoint's directory, `<directory>/step-<N:08d>`.

    Raises:
        CheckpointError: the state could not be written, or (other ranks) rank 0 did not write it.
        ValueError: keep is below 1.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    directory = Path(directory)
    if single_writer:
        return _save_single_writer(directory, step, state, keep)
    dist = _initialized_dist()
    if rank is None:
        rank = dist.get_rank() if dist is not None else 0
    if barrier is None and dist is not None:
        barrier = dist.barrier
    final = directory / step_dir_name(step)
    if rank != 0:
        if barrier is not None:
            barrier()
        if not (final / MANIFEST).is_file():
            raise CheckpointError(f"rank 0 did not save {final}")
        return final
    try:
        return _save(directory, step, state, keep)
    finally:
        if barrier is not None:
            barrier()  # also after a failure, so the other ranks do not hang


def commit_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    temp_dir: str | os.PathLike[str],
    *,
    keep: int = 3,
    single_writer: bool = False,
) -> Path:
    """Turn a filled temp dir (from `new_temp_dir`) into the verified checkpoint of `step`.

    This is the second half of `save_checkpoint`, for state another writer (DCP) put in the
    temp dir: it fsyncs and hashes every file, writes the manifest, renames the directory into
    place, moves `latest` and prunes. Call it on one rank only, after every writer finished.

    Args:
        directory: the checkpoint directory `temp_dir` is in.
        step: the training step the state belongs to.
        temp_dir: the directory holding the written files.
        keep: how many checkpoints to keep.
        single_writer: a survivor's commit (as in save_checkpoint): a verified checkpoint of `step`
            already in place (another survivor's) is kept, and other writers' temp dirs of `step` too.

    Returns:
        The checkpoint's directory, `<directory>/step-<N:08d>`.

    Raises:
        CheckpointError: the temp dir is empty or a file system operation failed.
        ValueError: keep is below 1.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    return _commit(Path(directory), step, Path(temp_dir), keep, state_file=None, single_writer=single_writer)


def verify_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """Why the checkpoint at `path` does not verify (a one-line reason), or None when it does.

    Checks that the manifest parses, names the directory's step, and that every file it lists
    exists with the recorded size and sha256.
    """
    try:
        _verified_manifest(Path(path))
    except _Invalid as exc:
        return str(exc)
    return None


def load_latest(
    directory: str | os.PathLike[str], *, map_location: Any = "cpu", allow_code_execution: bool = False
) -> LoadedCheckpoint | None:
    """Load the checkpoint `latest` names, or else the newest one that verifies.

    Each checkpoint passed over is logged (logger `gpuwatch.trainer`) and listed in `skipped`
    with its reason, e.g. ("step-00000040", "sha256 mismatch for state.pt").

    Args:
        directory: the checkpoint directory.
        map_location: passed to torch.load; "cpu" loads on any world size, load_state_dict moves it.
        allow_code_execution: let the checkpoint's files run code as this process: unpickle any
            object (a `state.pkl` or `state.pt` of custom objects: torch.load with weights_only=False)
            and return DCP checkpoints (dcp.load unpickles them). Only for checkpoints you trust.

    Returns:
        The loaded checkpoint, or None when the directory holds no checkpoint at all.

    Raises:
        CheckpointError: there are checkpoints, but none verifies and loads.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    skipped: list[tuple[str, str]] = []
    candidates = [path for _, path in _step_dirs(directory)]
    latest = _read_latest(directory)
    if latest is not None:
        if _STEP_DIR.match(latest) and (directory / latest).is_dir():
            candidates.sort(key=lambda path: path.name != latest)  # stable: the rest stay newest first
        else:
            _skip(skipped, latest, "named by latest but not there")
    for path in candidates:
        try:
            manifest = _verified_manifest(path, except_flat_state=True)
            state = _load_state(path, manifest, map_location, allow_code_execution)
        except _Invalid as exc:
            _skip(skipped, path.name, str(exc))
            continue
        except Exception as exc:  # whatever a crafted file provokes is a skip, never the caller's crash
            _skip(skipped, path.name, f"does not load: {type(exc).__name__}: {exc}")
            continue
        step = int(manifest["step"])
        for name in _leftovers(directory, newer_than=step):
            _skip(skipped, name, "left behind by an interrupted save")
        return LoadedCheckpoint(step=step, state=state, path=path, skipped=skipped)
    for name in _leftovers(directory, newer_than=-1):
        _skip(skipped, name, "left behind by an interrupted save")
    if candidates:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped)
        raise CheckpointError(f"no checkpoint in {directory} verifies ({reasons})")
    return None


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The step of the checkpoint `latest` names, from its manifest alone (nothing verified, no state read).

    What a restore from a host snapshot compares with: a snapshot older than the disk's newest is not
    the one to resume from. None when there is no `latest` or its manifest is unreadable.
    """
    directory = Path(directory)
    name = _read_latest(directory) if directory.is_dir() else None
    if name is None or not _STEP_DIR.match(name):
        return None
    try:
        step = json.loads(_read_small(directory / name, MANIFEST)).get("step")
    except (_Invalid, ValueError, AttributeError, RecursionError):
        return None
    return step if isinstance(step, int) else None


# -- saving ----------------------------------------------------------------------------------------


def _save_single_writer(directory: Path, step: int, state: Any, keep: int) -> Path:
    """Save with no barrier, race-safe against other processes saving the same step."""
    final = directory / step_dir_name(step)
    if final.is_dir() and verify_checkpoint(final) is None:
        log.info("checkpoint of step %d already in place and verified: %s", step, final)
        _write_latest(directory, final.name)
        return final
    return _save(directory, step, state, keep, single_writer=True)


def _save(directory: Path, step: int, state: Any, keep: int, *, single_writer: bool = False) -> Path:
    tmp = new_temp_dir(directory, step)
    torch = sys.modules.get("torch")
    flat = tensorfile.plan(state) if torch is not None else None
    state_file = FLAT_STATE if flat is not None else "state.pt" if torch is not None else "state.pkl"
    known: dict[str, list[tensorfile.Chunk]] = {}
    try:
        if flat is not None:
            known[state_file] = tensorfile.write_state_file(tmp / state_file, flat)
        else:
            with open(tmp / state_file, "wb") as f:
                if torch is not None:
                    torch.save(state, f)
                else:
                    pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
                f.flush()
                os.fsync(f.fileno())
    except Exception as exc:  # any failure to serialize or write is a failed save
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint of step {step} in {directory}: {exc}") from exc
    return _commit(directory, step, tmp, keep, state_file=state_file, single_writer=single_writer, known=known)


def save_flat_buffer(
    directory: str | os.PathLike[str],
    step: int,
    buffer: memoryview,
    chunks: list[tuple[int, int]],
    *,
    keep: int = 3,
    single_writer: bool = False,
) -> Path:
    """Save a flat tensor file already laid out in memory (a host snapshot's slot) as the checkpoint of `step`.

    The same guarantees as `save_checkpoint` (fresh dir, fsync, manifest, rename, `latest`); no
    serialising: the bytes go from `buffer` to the disk (O_DIRECT when the buffer is page aligned
    and the file system has it). No barrier: one process writes (`single_writer` as in save_checkpoint).

    Raises:
        CheckpointError: the file could not be written or committed.
        ValueError: keep is below 1.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    directory = Path(directory)
    if single_writer:
        final = directory / step_dir_name(step)
        if final.is_dir() and verify_checkpoint(final) is None:
            _write_latest(directory, final.name)
            return final
    tmp = new_temp_dir(directory, step)
    path = tmp / FLAT_STATE
    try:
        aligned = len(buffer) % tensorfile.PAGE == 0 and _address(buffer) % tensorfile.PAGE == 0
        fd, _ = tensorfile.open_for_write(path, direct=aligned)
        try:
            written = tensorfile.write_buffer(fd, buffer, chunks)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint of step {step} in {directory}: {exc}") from exc
    known = {FLAT_STATE: written}
    return _commit(directory, step, tmp, keep, state_file=FLAT_STATE, single_writer=single_writer, known=known)


def _address(buffer: memoryview) -> int:
    """The address of a writable buffer's first byte (an mmap slice is page aligned where the map is)."""
    import ctypes

    if len(buffer) == 0 or buffer.readonly:
        return 1
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _commit(
    directory: Path,
    step: int,
    tmp: Path,
    keep: int,
    *,
    state_file: str | None,
    single_writer: bool = False,
    known: dict[str, list[tensorfile.Chunk]] | None = None,
) -> Path:
    """Manifest, fsyncs, rename, `latest`, prune. `known`: files this process wrote and fsynced, with their chunks."""
    final = directory / step_dir_name(step)
    known = known or {}
    try:
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            name = path.relative_to(tmp).as_posix()
            if name == MANIFEST:
                continue
            chunks = known.get(name)
            if chunks is None:
                chunks = _chunks_of_file(path)  # another writer's (DCP): checksum and fsync it here
            files[name] = {"size": sum(c.length for c in chunks), CRC32: [list(c) for c in chunks]}
        if not files:
            raise OSError(f"no files in {tmp}")
        manifest = {
            "version": MANIFEST_VERSION,
            "step": step,
            "t": time.time(),
            "state_file": state_file,
            "files": files,
        }
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        for sub in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
            _fsync_dir(sub)
        if single_writer:
            _rename_unless_verified(tmp, final)
        else:
            _rename_into_place(tmp, final)
        _fsync_dir(directory)
        _write_latest(directory, final.name)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot commit checkpoint of step {step} in {directory}: {exc}") from exc
    _prune(directory, step, keep, leftovers_of_step=not single_writer)
    return final


def _rename_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; a checkpoint already there (a re-save of the same step) is replaced."""
    if not final.exists():
        os.rename(tmp, final)
        return
    aside = final.with_name(f".old-{final.name}-{os.getpid()}")
    os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def _rename_unless_verified(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final` unless another writer's verified checkpoint got there first.

    rename(2) onto a non-empty directory fails, so of several survivors renaming at once one wins;
    the others find its checkpoint, verify it and drop theirs. One that does not verify (a
    half-written leftover cannot carry a final name, but a damaged one can) is replaced.
    """
    try:
        os.rename(tmp, final)
        return
    except OSError:
        if not final.exists():
            raise
    if verify_checkpoint(final) is None:
        log.info("checkpoint %s was saved by another process meanwhile: keeping it", final)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    _rename_into_place(tmp, final)


def _write_latest(directory: Path, name: str) -> None:
    # Exclusive, no-follow, unguessable: a link planted under a temp name is never written through.
    tmp = directory / f"{LATEST}.tmp-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with open(fd, "wb") as f:
        f.write(f"{name}\n".encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    _fsync_dir(directory)


def _prune(directory: Path, step: int, keep: int, *, leftovers_of_step: bool = True) -> None:
    """Keep `step` and the keep-1 newest older checkpoints.

    Newer ones go too: they belong to a run that was resumed from an earlier step. Leftover temp
    dirs of steps up to `step` go as well (a later step's may still be being written), except, for
    a single-writer save, those of `step` itself: another survivor may be writing it right now.
    """
    dirs = _step_dirs(directory)
    last = step if leftovers_of_step else step - 1
    doomed = [path for s, path in dirs if s > step] + [path for s, path in dirs if s < step][keep - 1 :]
    doomed += [directory / name for name in _leftovers(directory, newer_than=-1) if _leftover_step(name) <= last]
    for path in doomed:
        log.info("removing checkpoint directory %s", path)
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("could not remove old checkpoint %s: %s", path, exc)


# -- loading ---------------------------------------------------------------------------------------

CRC32 = "crc32"


def _verified_manifest(path: Path, *, except_flat_state: bool = False) -> dict[str, Any]:
    """The manifest of the checkpoint at `path` once every file matches it; _Invalid says why not.

    With `except_flat_state`, a flat state file is left to `_load_state`, which verifies each chunk
    as it reads it (one pass over the bytes instead of two) and returns nothing that does not match.
    """
    try:
        manifest = json.loads(_read_small(path, MANIFEST))
    except _Invalid as exc:
        raise _Invalid(f"no {MANIFEST} (incomplete save)" if "missing" in str(exc) else str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise _Invalid(f"{MANIFEST} unreadable: {exc}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not isinstance(manifest.get("step"), int):
        raise _Invalid(f"{MANIFEST} malformed")
    match = _STEP_DIR.match(path.name)
    if match is not None and int(match.group(1)) != manifest["step"]:
        raise _Invalid(f"{MANIFEST} is for step {manifest['step']}")
    state_file = manifest.get("state_file")
    if state_file is not None and state_file not in files:
        raise _Invalid(f"{MANIFEST} does not list {state_file}")
    for name, entry in files.items():
        if not isinstance(name, str) or not Path(name).parts or ".." in Path(name).parts or Path(name).is_absolute():
            raise _Invalid(f"{MANIFEST} names a file outside the checkpoint: {name}")
        if not isinstance(entry, dict):
            raise _Invalid(f"{MANIFEST} malformed")
        if CRC32 in entry:
            skip = except_flat_state and name == state_file and name.endswith(".flat")
            _verify_crc32(path, name, entry, open_only=skip)
        else:  # manifest version 1
            _verify_sha256(path, name, entry)
    return manifest


def _verify_sha256(path: Path, name: str, entry: dict[str, Any]) -> None:
    fd = _open_member(path, name)
    try:
        size, sha256 = _hash_fd(fd)
    except OSError as exc:
        raise _Invalid(f"cannot read {name}: {exc}") from None
    finally:
        os.close(fd)
    if size != entry.get("size"):
        raise _Invalid(f"size mismatch for {name} (manifest {entry.get('size')}, file {size})")
    if sha256 != entry.get("sha256"):
        raise _Invalid(f"sha256 mismatch for {name}")


def _verify_crc32(path: Path, name: str, entry: dict[str, Any], *, open_only: bool = False) -> None:
    """Size and every chunk's crc32 (in parallel); `open_only`: the size only (the reader checks the chunks)."""
    chunks = _manifest_chunks(entry, name)
    fd = _open_member(path, name)
    try:
        size = os.fstat(fd).st_size
        if size != entry.get("size"):
            raise _Invalid(f"size mismatch for {name} (manifest {entry.get('size')}, file {size})")
        _check_chunk_lengths(chunks, size, name)
        if open_only:
            return
        try:
            reason = tensorfile.verify_fd(fd, size, chunks)
        except OSError as exc:
            raise _Invalid(f"cannot read {name}: {exc}") from None
        if reason is not None:
            raise _Invalid(f"{reason.replace('crc32 mismatch', 'crc32 mismatch for ' + name, 1)}")
    finally:
        os.close(fd)


def _manifest_chunks(entry: dict[str, Any], name: str) -> list[tensorfile.Chunk]:
    raw = entry.get(CRC32)
    try:
        chunks = [tensorfile.Chunk(int(o), int(n), int(c)) for o, n, c in raw]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise _Invalid(f"{MANIFEST} malformed ({name})") from None
    if not chunks:
        raise _Invalid(f"{MANIFEST} malformed ({name})")
    return chunks


def _check_chunk_lengths(chunks: list[tensorfile.Chunk], size: int, name: str) -> None:
    """Refuse chunks longer than any save writes, before a byte is read: a crc over 1 TiB is only known at its end.

    A save cuts a file into 16 MiB chunks after its first (a flat file's header and structure);
    a snapshot's slot uses longer ones only past 16k chunks, so never more than size/1024.
    """
    longest = max(tensorfile.CHUNK, size // 1024)
    if chunks[0].length > tensorfile.MAX_PREFIX or any(c.length > longest for c in chunks[1:]):
        biggest = max(c.length for c in chunks)
        raise _Invalid(f"{MANIFEST} has a chunk of {biggest} bytes for {name}: longer than any save writes")


def _load_state(path: Path, manifest: dict[str, Any], map_location: Any, allow_code_execution: bool) -> Any:
    state_file = manifest.get("state_file")
    if state_file is None:
        if not allow_code_execution:
            raise _Invalid("a DCP checkpoint (dcp.load unpickles it: load it with allow_code_execution=True)")
        return None
    if not isinstance(state_file, str):
        raise _Invalid(f"{MANIFEST} malformed (state_file)")
    if state_file.endswith(".flat"):
        return _load_flat(path, state_file, manifest["files"][state_file], map_location)
    if not state_file.endswith((".pkl", ".pt")):
        raise _Invalid(f"{state_file} is not a format gpuwatch writes")
    fd = _open_member(path, state_file)
    try:
        with os.fdopen(fd, "rb") as f:
            if state_file.endswith(".pkl"):
                return _unpickle(f, state_file, allow_code_execution)
            torch = _import_torch()
            if torch is None:
                raise _Invalid(f"{state_file} needs torch, which is not installed")
            _check_inflation(f, state_file)
            return torch.load(f, map_location=map_location, weights_only=not allow_code_execution)
    except _Invalid:
        raise
    except Exception as exc:  # a file that verifies but does not unpickle: skip it like a corrupt one
        raise _Invalid(f"{state_file} does not load: {type(exc).__name__}: {exc}") from None


def _check_inflation(f: io.BufferedReader, name: str) -> None:
    """Refuse a `state.pt` whose records would inflate past the file's own size, before torch.load reads it.

    torch.save stores its zip records uncompressed, so what it wrote unpacks to about its size; a
    deflated record (a crafted file: 1 MB that inflates to 1 GiB) is refused from the zip's
    directory alone, with nothing inflated. A file that is no zip (torch's legacy format) is left to
    torch.load.
    """
    size = os.fstat(f.fileno()).st_size
    try:
        with zipfile.ZipFile(f) as archive:
            records = archive.infolist()
    except zipfile.BadZipFile:
        f.seek(0)
        return
    f.seek(0)
    packed = [r.filename for r in records if r.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise _Invalid(f"{name}: compressed record {packed[0]!r} (torch.save never compresses: a crafted file)")
    total = sum(r.file_size for r in records)
    if total > size:
        raise _Invalid(f"{name}: its records hold {total} bytes, more than the file's {size}")


def _unpickle(f: io.BufferedReader, name: str, allow_code_execution: bool) -> Any:
    """A `state.pkl`: plain values through the allow-list unpickler; anything with `allow_code_execution`."""
    if allow_code_execution:
        return pickle.load(f)
    try:
        return tensorfile.build_state(f.read(), ())
    except tensorfile.FlatFileError as exc:
        raise _Invalid(f"{name} holds more than plain values ({exc}; allow_code_execution=True loads it)") from None


def _load_flat(path: Path, name: str, entry: dict[str, Any], map_location: Any) -> Any:
    """Read the flat state and verify every chunk as it comes (in parallel); nothing is returned unverified."""
    if sys.modules.get("torch") is None and _import_torch() is None:
        raise _Invalid(f"{name} needs torch, which is not installed")
    chunks = _manifest_chunks(entry, name)
    fd = _open_member(path, name)
    direct_fd = tensorfile.open_direct(f"/proc/self/fd/{fd}")  # the same file, not whatever the name is now
    try:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return tensorfile.read_flat(fd, os.fstat(fd).st_size, chunks, map_location, direct_fd=direct_fd)
    except tensorfile.FlatFileError as exc:
        raise _Invalid(f"{str(exc).replace('crc32 mismatch', 'crc32 mismatch for ' + name, 1)}") from None
    except OSError as exc:
        raise _Invalid(f"cannot read {name}: {exc}") from None
    finally:
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)


def _open_member(path: Path, name: str) -> int:
    """`name` (relative) of the checkpoint at `path`, opened read-only: a regular file inside it, or _Invalid."""
    return _open_below(path.parent, [path.name, *Path(name).parts], name)


def _open_below(top: Path, parts: list[str], name: str) -> int:
    """`top/parts...` opened read-only, with no link on the way below `top`: a regular file, or _Invalid.

    Each component is opened from its parent's fd with O_NOFOLLOW (a link anywhere below `top`
    is refused), the file also O_NONBLOCK, so a FIFO or a device answers at once and is refused
    by its type. `top` itself (the checkpoint directory the caller chose) may be a link.
    """
    try:
        fd = os.open(top, _DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError as exc:
        raise _Invalid(f"cannot open {top}: {_why(exc)}") from None
    try:
        for part in parts[:-1]:
            try:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                raise _Invalid(f"missing {name}") from None
            except OSError as exc:
                raise _Invalid(f"cannot open {name}: {part} is {_why(exc)}") from None
            os.close(fd)
            fd = sub
        try:
            file = os.open(parts[-1], _OPEN_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            raise _Invalid(f"missing {name}") from None
        except OSError as exc:
            raise _Invalid(f"cannot open {name}: {_why(exc)}") from None
    finally:
        os.close(fd)
    mode = os.fstat(file).st_mode
    if not stat.S_ISREG(mode):
        os.close(file)
        raise _Invalid(f"{name} is not a regular file ({_kind(mode)})")
    return file


def _why(exc: OSError) -> str:
    """An open's error in words; ELOOP from O_NOFOLLOW means the name is a symbolic link."""
    if exc.errno == errno.ELOOP:
        return "a symbolic link"
    return "not a directory" if exc.errno == errno.ENOTDIR else exc.strerror or str(exc)


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return "not a plain file"


def _read_small(path: Path, name: str, limit: int = _MAX_SMALL_FILE) -> bytes:
    """The whole of a small file (`manifest.json`, `latest`) in directory `path`, opened as `_open_below` does."""
    fd = _open_below(path, [name], name)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise _Invalid(f"{name} is {size} bytes, more than {limit}")
        data = os.pread(fd, size, 0)
    except OSError as exc:
        raise _Invalid(f"cannot read {name}: {exc}") from None
    finally:
        os.close(fd)
    return data


def _read_latest(directory: Path) -> str | None:
    try:
        return _read_small(directory, LATEST, limit=4096).decode().strip() or None
    except _Invalid as exc:
        if not str(exc).startswith("missing"):
            log.warning("cannot read %s: %s", directory / LATEST, exc)
        return None
    except UnicodeDecodeError as exc:
        log.warning("cannot read %s: %s", directory / LATEST, exc)
        return None


def _skip(skipped: list[tuple[str, str]], name: str, reason: str) -> None:
    log.warning("skipped checkpoint %s: %s", name, reason)
    skipped.append((name, reason))


# -- helpers ---------------------------------------------------------------------------------------


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """The `step-*` directories, newest first."""
    found = []
    for path in directory.iterdir():
        match = _STEP_DIR.match(path.name)
        if match is not None and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def _leftovers(directory: Path, *, newer_than: int) -> list[str]:
    """Names of temp dirs a save left behind (crash, kill), for steps above `newer_than`."""
    return sorted(
        path.name
        for path in directory.iterdir()
        if _LEFTOVER_DIR.match(path.name) and path.is_dir() and _leftover_step(path.name) > newer_than
    )


def _leftover_step(name: str) -> int:
    match = _LEFTOVER_DIR.match(name)
    return int(match.group(1)) if match else -1


def _hash_fd(fd: int) -> tuple[int, str]:
    """Size and sha256 of an open regular file (manifest version 1), read up to the size fstat gives."""
    digest = hashlib.sha256()
    size = os.fstat(fd).st_size
    done = 0
    while done < size and (chunk := os.pread(fd, min(_CHUNK, size - done), done)):
        digest.update(chunk)
        done += len(chunk)
    return done, digest.hexdigest()


def _chunks_of_file(path: Path) -> list[tensorfile.Chunk]:
    """crc32 chunks of a file another writer made, read in parallel; then fsync it (DCP fsyncs its own: cheap)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        chunks = tensorfile.chunks_of_fd(fd, os.fstat(fd).st_size)
        os.fsync(fd)
        return chunks
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (fsync(2): the file's fsync does not cover it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _initialized_dist() -> Any:
    """torch.distributed when the program imported torch and initialized a process group, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _import_torch() -> ModuleType | None:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None
