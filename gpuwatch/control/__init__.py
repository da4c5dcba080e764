"""The control plane: how a client knows it talks to the daemon, and who may change the daemon's state.

* `peer`: the credentials the kernel vouches for on a Unix socket (SO_PEERCRED, SO_PEERGROUPS).
* `connect`: the client's side: the control socket is refused unless root (or the caller itself)
  made it and still listens on it, so no local user can stand in for the daemon.
* `access`: the server's side: who may change state over the control socket.
* `hosts`: which Host headers the TCP listener answers (DNS rebinding).

Stdlib only: the CLI imports it before anything heavy, the daemon's HTTP layer on every connection.
"""
