"""The processes a bench starts (``edged run``s, busy loops) end with the bench, however it ends.

Each bench kills what it started in a ``finally``; `edged bench` turns SIGTERM into an exit so
that those run. Python runs its fork hooks (``os.register_at_fork``: logging's lock, for one) in
the parent after every fork, and an exception a signal handler raises inside one is printed and
dropped, so a SIGTERM or Ctrl-C that lands there would leave the bench running on. ``start``
therefore holds both signals back while it forks and waits for the child's exec, and lets them
in after, where the exit they raise is not lost; the child is given the bench's signal mask back
before its exec. SIGKILL gets round every ``finally``, so each child also asks the kernel, before
its exec, to be killed when the bench dies (``PR_SET_PDEATHSIG``, Linux).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Iterable
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HELD = {signal.SIGINT, signal.SIGTERM}  # the signals a bench turns into an exit

_libc = ctypes.CDLL(None, use_errno=True)


def _die_with(parent: int, mask: Iterable[int]) -> Callable[[], None]:
    def arm() -> None:  # in the child, between fork and exec: nothing but system calls
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the bench died before the request was made
            os._exit(1)

    return arm


def start(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)``, killed by the kernel if the bench dies first."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        return subprocess.Popen(argv, preexec_fn=_die_with(os.getpid(), mask), **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
