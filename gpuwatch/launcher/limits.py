"""The job's descriptor limit: raised to the hard limit before any rank starts.

A gloo rank accepts its peers' connections on a listener every local user can reach; at the usual
soft limit (1024) about a thousand idle connections from anyone make its `accept()` fail with
EMFILE, and gloo ends the process. The hard limit (often far higher) is the user's own to take, and
the ranks inherit it from the launch.
"""

from __future__ import annotations

import resource


def raise_descriptor_limit() -> tuple[int, int]:
    """Set RLIMIT_NOFILE's soft limit to its hard limit; (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return soft, hard
    return soft, soft
