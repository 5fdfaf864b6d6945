"""Child processes that die with the command that started them.

`specrouter demo` starts a simulator and `specrouter launch-pair` two SGLang servers in
their own sessions (so a Ctrl-C reaches the parent only, which stops them in order). A
parent killed with SIGKILL runs no cleanup at all, so on Linux each child also asks the
kernel for a parent-death signal (`prctl(PR_SET_PDEATHSIG)`): when the parent dies, however
it dies, the child gets `signal` and stops itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` that sets the parent-death signal; None where
    the platform has none (the child then outlives a parent killed with SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        # The parent may have died between fork and prctl: the signal would never come.
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec
