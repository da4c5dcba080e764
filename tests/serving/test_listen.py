"""`listen` takes HOST:PORT where HOST is an address or a host name; a name that does not resolve is one line."""

from __future__ import annotations

import socket

import pytest

from gpuwatch.config import Config
from gpuwatch.errors import ConfigError
from gpuwatch.serving.listeners import bind_tcp


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_a_host_name_or_address_binds_and_answers(host: str) -> None:
    sock = bind_tcp(Config(listen=f"{host}:0"))
    try:
        sock.listen()
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass
    finally:
        sock.close()


def test_a_name_that_does_not_resolve_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_such_name(*_args: object, **_kwargs: object) -> list[object]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    with pytest.raises(ConfigError, match=r"^listen gpu-node-7:9835: cannot resolve 'gpu-node-7': Name or service"):
        bind_tcp(Config(listen="gpu-node-7:9835"))
