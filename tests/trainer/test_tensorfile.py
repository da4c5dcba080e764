"""Flat tensor files: every dtype and shape round trips, chunks verify, and only plain values are unpickled."""

from __future__ import annotations

import os
import pickle
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from gpuwatch.trainer import tensorfile
from gpuwatch.trainer.tensorfile import FlatFileError


def _write(path: Path, state: Any, chunk: int = tensorfile.CHUNK) -> tuple[int, list[tensorfile.Chunk]]:
    flat = tensorfile.plan(state)
    assert flat is not None
    chunks = tensorfile.write_state_file(path, flat, chunk=chunk)
    return flat.size, chunks


def _read(path: Path, chunks: list[tensorfile.Chunk]) -> Any:
    fd = os.open(path, os.O_RDONLY)
    try:
        return tensorfile.read_flat(fd, os.fstat(fd).st_size, chunks)
    finally:
        os.close(fd)


def test_every_kind_of_tensor_and_value_round_trips(tmp_path: Path) -> None:
    weight = torch.randn(3, 5)
    state = {
        "model": OrderedDict(w=weight, tied=weight, half=torch.randn(7).half(), bf16=torch.randn(9).bfloat16()),
        "ints": torch.arange(11, dtype=torch.int64), "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "complex": torch.randn(3, dtype=torch.cfloat),
        "transposed": torch.randn(4, 6).t(), "param": torch.nn.Parameter(torch.ones(2)),
        "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1], "name": "x", "none": None}],
        "shape": torch.Size([2, 3]), "dtype": torch.float16, "device": torch.device("cpu"), "blob": b"\x00\x01",
        "misc": {1, 2}, "frozen": frozenset({3}),
    }  # fmt: skip
    size, chunks = _write(tmp_path / "s.flat", state)

    loaded = _read(tmp_path / "s.flat", chunks)

    assert size == (tmp_path / "s.flat").stat().st_size and size % tensorfile.PAGE == 0
    assert isinstance(loaded["model"], OrderedDict) and loaded["model"]["tied"] is loaded["model"]["w"]
    for key in ("ints", "flags", "scalar", "empty", "complex", "transposed"):
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key]), key
    for key in ("w", "half", "bf16"):
        assert torch.equal(loaded["model"][key], state["model"][key]), key
    assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["param"].requires_grad
    for key in ("groups", "shape", "dtype", "device", "blob", "misc", "frozen"):
        assert loaded[key] == state[key], key


def test_a_state_spanning_many_chunks_is_read_back_and_each_chunk_checked(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(3000 + i) for i in range(20)}  # ~240 KiB in 16 KiB chunks
    _, chunks = _write(tmp_path / "s.flat", state, chunk=16384)
    assert len(chunks) > 10 and chunks[0].offset == 0

    loaded = _read(tmp_path / "s.flat", chunks)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())

    path = tmp_path / "s.flat"
    data = bytearray(path.read_bytes())
    victim = chunks[7]
    data[victim.offset + 100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(FlatFileError, match=f"crc32 mismatch in bytes {victim.offset}-{victim.offset + victim.length}"):
        _read(path, chunks)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert (
            tensorfile.verify_fd(fd, len(data), chunks)
            == f"crc32 mismatch in bytes {victim.offset}-{victim.offset + victim.length}"
        )
        assert tensorfile.verify_fd(fd, len(data), chunks[1:]) == "chunk list does not tile the file"
    finally:
        os.close(fd)


class Custom:
    pass


@pytest.mark.parametrize(
    "state", [{"x": Custom()}, {"x": torch.randn(3).to_sparse()}, {"x": torch.randn(2, device="meta")}]
)
def test_what_a_flat_file_cannot_hold_is_left_to_torch_save(state: Any) -> None:
    assert tensorfile.plan(state) is None


def test_a_structure_naming_anything_else_is_refused_even_with_matching_checksums(tmp_path: Path) -> None:
    """A flat file is read by code that unpickles only plain values: a crafted one cannot run anything."""
    _, chunks = _write(tmp_path / "s.flat", {"w": torch.ones(2)})
    data = bytearray((tmp_path / "s.flat").read_bytes())
    _, _, _, meta_off, meta_len, data_off, _ = tensorfile.HEADER.unpack_from(data)
    evil = pickle.dumps({"tree": pickle.dumps(os.system), "tensors": []}, protocol=4)
    assert len(evil) <= data_off - meta_off
    struct.pack_into("<Q", data, 24, len(evil))  # meta_len
    data[meta_off : meta_off + len(evil)] = evil
    (tmp_path / "s.flat").write_bytes(bytes(data))
    import zlib

    chunks[0] = tensorfile.Chunk(0, data_off, zlib.crc32(data[:data_off]))

    with pytest.raises(FlatFileError, match="posix.system is not allowed in a flat file"):
        _read(tmp_path / "s.flat", chunks)


def test_the_chunk_count_is_the_number_of_chunk_ranges_without_making_them() -> None:
    """A slot's header is checked at every snapshot: the count is arithmetic, and must agree with the list."""
    for data_off in (0, 1, 4096, 5000, 70000):
        for size in (0, 1, 4095, 4096, 5000, 5001, 69999, 70000, 70001, 1 << 20, (1 << 20) + 3):
            for chunk in (1, 7, 4096, 65536, 16 << 20):
                if size - data_off > 200_000 and chunk < 4096:
                    continue  # the list would be long; the arithmetic is the same
                expected = len(tensorfile.chunk_ranges(data_off, size, chunk))
                assert tensorfile.chunk_count(data_off, size, chunk) == expected, (data_off, size, chunk)
    with pytest.raises(ValueError, match="chunk size 0 is not positive"):
        tensorfile.chunk_count(4096, 8192, 0)
