"""The job's store and its secret: a client that proves the secret gets torch's Store, nobody else gets a
byte, and a server that cannot prove it is never told anything. The secret file must be the user's own."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpuwatch.inplace.jobstore import JobStore, StoreAuthError, StoreServer  # noqa: E402
from gpuwatch.inplace.secret import SecretError, new_secret_file, read_secret  # noqa: E402

SECRET = os.urandom(32).hex().encode()
TIMEOUT = datetime.timedelta(seconds=5)


@pytest.fixture
def server() -> Iterator[StoreServer]:
    served = StoreServer("127.0.0.1", 0, SECRET)
    yield served
    served.close()


def test_a_client_with_the_secret_gets_the_whole_store_interface_and_a_process_group(server: StoreServer) -> None:
    store = JobStore("127.0.0.1", server.port, SECRET, TIMEOUT)
    store.set("a", "1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["b"])
    assert store.add("n", 2) == 2 and store.add("n", 0) == 2
    assert store.compare_set("a", "1", "2") == b"2" and store.get("a") == b"2"
    threading.Timer(0.2, lambda: server.data.set("late", "x")).start()
    store.wait(["late"])  # blocks until another client sets it
    assert store.delete_key("late") and store.num_keys() == 2
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], datetime.timedelta(milliseconds=200))
    dist.PrefixStore("c", store).clone().set("k", "v")  # torch clones a store to split a process group
    assert store.get("c/k") == b"v"
    prefixed = dist.PrefixStore("pg/1", store)  # what a generation's process group rendezvouses through
    dist.init_process_group("gloo", store=prefixed, rank=0, world_size=1)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
    finally:
        dist.destroy_process_group()


def test_a_client_without_the_secret_is_refused_and_reads_nothing(server: StoreServer) -> None:
    server.data.set("gen", "1")
    with pytest.raises(StoreAuthError):
        JobStore("127.0.0.1", server.port, b"0" * 64, TIMEOUT)
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    raw.sendall(b"GWIS2" + os.urandom(32))  # a client's hello: the server proves itself first
    greeting = raw.recv(100)
    raw.sendall(b"\x00" * 32)  # a wrong proof
    assert len(greeting) == 69 and raw.recv(100) == b""  # its nonce and its proof, then closed


def test_a_server_that_cannot_prove_the_secret_is_told_nothing() -> None:
    impostor = StoreServer("127.0.0.1", 0, b"f" * 64)
    try:
        with pytest.raises(StoreAuthError):
            JobStore("127.0.0.1", impostor.port, SECRET, TIMEOUT)
        assert impostor.data.num_keys() == 0
    finally:
        impostor.close()


def test_a_new_secret_lives_in_a_directory_only_its_user_enters(tmp_path: Path) -> None:
    path = new_secret_file()
    try:
        assert (path.parent.stat().st_mode & 0o777, path.stat().st_mode & 0o777) == (0o700, 0o600)
        assert len(read_secret(path)) == 64
    finally:
        path.unlink()
        path.parent.rmdir()


@pytest.mark.parametrize("case", ["world-readable", "link", "fifo", "short", "missing"])
def test_a_secret_file_that_is_not_the_users_own_private_file_is_one_line(tmp_path: Path, case: str) -> None:
    path = tmp_path / "secret"
    real = tmp_path / "real"
    real.write_text("a" * 64)
    real.chmod(0o600)
    if case == "world-readable":
        path.write_text("a" * 64)
        path.chmod(0o644)
    elif case == "link":
        path.symlink_to(real)
    elif case == "fifo":
        os.mkfifo(path, 0o600)
    elif case == "short":
        path.write_text("abc")
        path.chmod(0o600)
    with pytest.raises(SecretError) as raised:
        read_secret(path)
    message = str(raised.value)
    assert message.startswith(f"secret file {path}: ") and "\n" not in message, message


def test_a_watch_answers_at_the_change_a_counter_wait_at_its_target_and_a_timeout_with_what_is(
    server: StoreServer,
) -> None:
    """The long poll a rank's membership holds, and the one-key meeting: no polling anywhere."""
    from gpuwatch.inplace.jobstore import GE, NE, READ, encoded

    store = JobStore("127.0.0.1", server.port, SECRET, TIMEOUT)
    server.data.set("gen", "1")
    server.data.set("delta", "d1")
    assert store.watch([("gen", NE, b""), ("delta", READ, b"")], 5.0) == [b"1", b"d1"]  # differs: at once
    threading.Timer(0.3, lambda: server.data.set("gen", "2")).start()
    started = time.monotonic()
    assert store.watch([("gen", NE, encoded(b"1"))], 5.0) == [b"2"]
    assert 0.2 < time.monotonic() - started < 2.0
    for _ in range(2):
        threading.Timer(0.2, lambda: server.data.add("ready/2", 1)).start()
    assert store.watch([("ready/2", GE, b"2"), ("gen", NE, encoded(b"2"))], 5.0) == [b"2", b"2"]
    server.data.set("words", "not a count")
    started = time.monotonic()
    assert store.watch([("words", GE, b"1")], 0.3) == [b"not a count"]  # the timeout, with what is there
    assert 0.25 < time.monotonic() - started < 2.0
    before = server.requests
    time.sleep(0.5)
    assert server.requests == before  # nothing asked while a watch waits
