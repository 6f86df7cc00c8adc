"""The processes a bench starts (``edged run``s, busy loops) end with the bench, however it ends.

Each bench kills what it started in a ``finally``; `edged bench` turns SIGTERM into an exit so
that those run. Two ways round them remain: a signal while ``Popen`` waits for the child's exec
(the child exists, its ``Popen`` never returns), and SIGKILL. So each child also asks the kernel,
before its exec, to be killed when the bench dies (``PR_SET_PDEATHSIG``, Linux).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_libc = ctypes.CDLL(None, use_errno=True)


def _die_with(parent: int) -> Callable[[], None]:
    def arm() -> None:  # in the child, between fork and exec: nothing but two system calls
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the bench died before the request was made
            os._exit(1)

    return arm


def start(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)``, killed by the kernel if the bench dies first."""
    return subprocess.Popen(argv, preexec_fn=_die_with(os.getpid()), **kwargs)
