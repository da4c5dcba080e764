"""Who may change the daemon's state over its control socket: decided on the kernel's word (peer.PeerCred).

Root, the daemon's own user (a daemon run by hand as a normal user is that user's), and the members
of `api.admin_group` when one is configured. Everyone else may read over the socket as over TCP, and
may change state only with the bearer token.
"""

from __future__ import annotations

import grp
import os
from dataclasses import dataclass

from gpuwatch.control.peer import PeerCred
from gpuwatch.errors import ConfigError


@dataclass(frozen=True)
class Access:
    """The uids and the group that may change state without the token."""

    daemon_uid: int
    admin_gid: int | None = None
    admin_group: str = ""

    @classmethod
    def for_daemon(cls, admin_group: str) -> Access:
        """This process's uid, and `admin_group` resolved now.

        Raises:
            ConfigError: no such group.
        """
        if not admin_group:
            return cls(os.geteuid())
        try:
            return cls(os.geteuid(), grp.getgrnam(admin_group).gr_gid, admin_group)
        except KeyError:
            raise ConfigError(f"api.admin_group: no group {admin_group!r} on this host") from None

    def may_change_state(self, peer: PeerCred) -> bool:
        if peer.uid in (0, self.daemon_uid):
            return True
        return self.admin_gid is not None and peer.in_group(self.admin_gid)

    def who(self) -> str:
        """Who may, in words, for a refusal."""
        users = "root" if self.daemon_uid == 0 else f"root and uid {self.daemon_uid} (the daemon's)"
        return f"{users} and members of group {self.admin_group}" if self.admin_group else users
