"""The job store's handshake against another local user (mallory, a throwaway account made by useradd).

* Tying up the handshake: before, 32 connections that each sent a byte every 4 s held every
  handshake slot for minutes (the 5 s timeout was per `recv`), and every replacement rank's connect
  failed. Now a connection another user of the node made is closed before the greeting (the kernel
  says whose socket it is), and any connection not proved within HANDSHAKE_S of its accept is closed.
* Squatting the endpoint: before, a process that listened where the job's launchers connect got a
  client's HMAC proof over a nonce of its own choosing (an offline oracle for a weak secret), and the
  message blamed the secret. Now the client does not talk to another user's store, and where that
  cannot be told the server proves first: the client sends its nonce and nothing else.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from gpuwatch.inplace.jobstore import HANDSHAKE_S, JobStore, StoreAuthError, StoreServer  # noqa: E402
from tests.hardening.conftest import local_users  # noqa: E402

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a user")]
SECRET = os.urandom(32).hex().encode()

AS_MALLORY = """
import encodings.idna, json, os, socket, sys, time  # imports done before she is mallory
uid, what, port = json.loads(sys.stdin.readline())
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
def greeting(sock):
    sock.settimeout(3)
    try:
        got = sock.recv(100)
    except socket.timeout:
        return "nothing"
    except OSError:  # reset: closed with her hello unread
        return "closed"
    return got.hex() if got else "closed"
if what == "read":  # connect, say hello as a client does, read what the store says
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(b"GWIS2" + os.urandom(32))
    except OSError:
        pass
    print(json.dumps({"answer": greeting(sock)}), flush=True)
elif what == "hold":  # hold 40 handshakes open, a byte every second each
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    print(json.dumps({"holding": len(socks)}), flush=True)
    for _ in range(20):
        for sock in socks:
            try:
                sock.send(b"G")
            except OSError:
                pass
        time.sleep(1)
elif what == "squat":  # listen, greet each client as the store did, keep what it says
    listener = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    listener.settimeout(8)
    heard = []
    try:
        while True:
            conn, _ = listener.accept()
            nonce = os.urandom(32)
            said = b""
            try:
                conn.sendall(b"GWIS1" + nonce)
                conn.settimeout(1.5)
                while len(said) < 200:
                    chunk = conn.recv(200)
                    if not chunk:
                        break
                    said += chunk
            except OSError:  # a timeout, or the client closed at once
                pass
            heard.append([nonce.hex(), said.hex()])
            conn.close()
    except socket.timeout:
        pass
    print(json.dumps({"heard": heard}), flush=True)
"""


@pytest.fixture(scope="module")
def mallory() -> Iterator[int]:
    with local_users("gw-handshake-mallory") as (user,):
        yield user.pw_uid


@pytest.fixture
def server() -> Iterator[StoreServer]:
    served = StoreServer("127.0.0.1", 0, SECRET)
    yield served
    served.close()


def as_mallory(uid: int, what: str, port: int = 0) -> subprocess.Popen[str]:
    attack = subprocess.Popen(
        [sys.executable, "-c", AS_MALLORY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert attack.stdin is not None
    attack.stdin.write(json.dumps([uid, what, port]) + "\n")
    attack.stdin.flush()
    return attack


def said(attack: subprocess.Popen[str]) -> dict[str, object]:
    assert attack.stdout is not None
    line = attack.stdout.readline()
    assert line, f"mallory's process said nothing: {attack.stderr.read() if attack.stderr else ''}"
    return dict(json.loads(line))


def connect(port: int, timeout_s: float = 10.0) -> JobStore:
    return JobStore("127.0.0.1", port, SECRET, datetime.timedelta(seconds=timeout_s))


def test_another_users_connection_is_closed_before_the_store_says_a_word(server: StoreServer, mallory: int) -> None:
    attack = as_mallory(mallory, "read", server.port)
    answer = said(attack)["answer"]
    attack.wait(timeout=30)
    assert answer == "closed", f"mallory read {answer!r} from the job's store"
    assert server.refused >= 1


def test_another_users_held_handshakes_do_not_keep_a_rank_out(server: StoreServer, mallory: int) -> None:
    attack = as_mallory(mallory, "hold", server.port)
    try:
        assert said(attack) == {"holding": 40}
        time.sleep(1.5)  # two of her bytes on each connection
        started = time.monotonic()
        connect(server.port).set("replacement", "joined")
        waited = time.monotonic() - started
    finally:
        attack.kill()
        attack.wait()
    assert waited < 3.0, f"a rank's connect waited {waited:.1f} s behind mallory's handshakes"


@pytest.mark.slow
def test_a_handshake_that_drips_is_closed_at_its_deadline_from_accept(server: StoreServer) -> None:
    """Where the kernel cannot tell whose the connection is (another node), the deadline is total."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    started, closed_after = time.monotonic(), None
    sock.settimeout(0.1)
    for _ in range(int(HANDSHAKE_S * 4)):  # a byte of the hello every 0.5 s: no recv ever waits 5 s
        try:
            sock.send(b"G")
            if sock.recv(100) == b"":
                closed_after = time.monotonic() - started
                break
        except TimeoutError:
            pass
        except OSError:
            closed_after = time.monotonic() - started
            break
        time.sleep(0.4)
    sock.close()
    assert closed_after is not None and closed_after < HANDSHAKE_S + 2.0, closed_after


def _proofs_in(heard: list[list[str]]) -> list[str]:
    """The client proofs mallory could test a guessed secret against (HMACs over her nonce and the client's)."""
    found = []
    for nonce_hex, said_hex in heard:
        nonce, data = bytes.fromhex(nonce_hex), bytes.fromhex(said_hex)
        for at in range(len(data) - 63):
            theirs, proof = data[at : at + 32], data[at + 32 : at + 64]
            if hmac.compare_digest(proof, hmac.new(SECRET, b"client" + nonce + theirs, hashlib.sha256).digest()):
                found.append(said_hex)
    return found


@pytest.mark.slow
def test_a_squatter_on_the_endpoint_gets_nothing_to_test_a_guess_against(mallory: int) -> None:
    attack = as_mallory(mallory, "squat")
    try:
        port = int(str(said(attack)["port"]))
        with pytest.raises((StoreAuthError, OSError)) as raised:
            connect(port, timeout_s=2.0)
        heard = list(said(attack)["heard"])  # type: ignore[call-overload]
    finally:
        attack.kill()
        attack.wait()
    assert not _proofs_in(heard), "the client gave mallory its proof over her nonce: an offline oracle"
    message = str(raised.value)
    assert "secret" not in message or "another user" in message, message


def test_where_the_owner_cannot_be_told_the_client_sends_only_its_nonce_until_the_server_proved() -> None:
    """A squatter the kernel cannot name (another node's): it answers the hello with a proof it cannot make."""
    listener = socket.create_server(("127.0.0.1", 0))
    heard: list[bytes] = []

    def squat() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(2)
            hello = conn.recv(100)
            conn.sendall(b"GWIS2" + os.urandom(64))  # a nonce and a proof made without the secret
            time.sleep(0.5)
            conn.settimeout(0.5)
            try:
                heard.append(hello + conn.recv(100))
            except TimeoutError:
                heard.append(hello)

    thread = threading.Thread(target=squat)
    thread.start()
    with pytest.raises(StoreAuthError) as raised:
        connect(listener.getsockname()[1], timeout_s=3.0)
    thread.join()
    listener.close()
    assert len(heard[0]) == 37 and heard[0].startswith(b"GWIS2"), heard  # its hello, and not a byte more
    assert "did not prove" in str(raised.value), raised.value
