"""Which Host headers the TCP listener answers: a defence against DNS rebinding.

A web page the browser loaded from attacker.example can make its name resolve to 127.0.0.1 and then
read http://attacker.example:9835/v1/gpus as "same origin"; the request still says
`Host: attacker.example`. Answered are: IP literals (a browser's origin is then the address
itself, which rebinding cannot give), loopback names, this host's name, the listen address's host,
and `api.allowed_hosts` (`"*"` answers any). The port is not compared: rebinding works on any port.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


class HostPolicy:
    def __init__(self, names: Iterable[str]) -> None:
        wanted = {_normal(name) for name in names if name}
        self.any = "*" in wanted
        self.names = frozenset(LOOPBACK_NAMES | wanted)

    def allows(self, header: str) -> bool:
        host = _host_part(header)
        if not host:
            return False
        if self.any or host in self.names or host.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        return True


def _host_part(header: str) -> str:
    """`example.org` of `Example.ORG.:9835`, `::1` of `[::1]:9835`; '' when it is not a host."""
    text = header.strip()
    if text.startswith("["):
        end = text.find("]")
        return text[1:end].lower() if end > 0 else ""
    host, _, port = text.partition(":")
    if port and not port.isdigit():
        return ""
    return _normal(host)


def _normal(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()
