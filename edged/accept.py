"""The process out of file descriptors, or the kernel out of memory: accepting connections, and libzmq.

A listening socket with a connection waiting stays readable while ``accept`` fails with EMFILE (the
unit's ``LimitNOFILE=`` reached, or a descriptor leak), so a server that only returns to its poll
spins a core and starves the frame loop of the GIL; asyncio pauses 1 s, but logs a traceback for
each of up to 100 tries per pause. Each of edged's servers (the live view, Modbus TCP, OPC UA) says
such a failure once, then at most once a minute with the count since start, and tries again after a
pause: the client waits in the listen backlog and is served once a descriptor is free again.

libzmq aborts the whole process (an assertion, exit 134) where it cannot open a descriptor of its
own, as its threads' pollers and its bind's interface lookup: `make_room` goes first.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from edged.errors import OUT_OF_ROOM

if TYPE_CHECKING:
    import asyncio

log = logging.getLogger(__name__)

# What ``accept`` fails with when the process or the system has no room for one more connection.
OUT_OF_RESOURCES = OUT_OF_ROOM | {errno.ENOBUFS}
ACCEPT_RETRY_S = 0.25  # the pause before a failed accept is tried again (asyncio's own is 1 s)
LOG_INTERVAL_S = 60.0
# What libzmq may open for a socket: its context's I/O and reaper threads' pollers and mailboxes and the
# context's and the socket's own mailboxes; for a bind, the netlink socket it looks the interfaces up by,
# closed before the listener is opened.
ZMQ_SOCKET_ROOM = 6
ZMQ_BIND_ROOM = 1
ASYNCIO_ACCEPT_MESSAGE = "socket.accept() out of system resource"  # asyncio's context message for such a failure


def why(error: BaseException) -> str:
    """What ran out, and where to look, for an accept or a thread start that failed with ``error``."""
    if isinstance(error, RuntimeError):  # threading: "can't start new thread"
        return f"{error}: the process may start no more threads, TasksMax= too low or a thread leak"
    errno_ = getattr(error, "errno", None)  # an OSError's, or libzmq's (`zmq.ZMQError`)
    cause = getattr(error, "strerror", None) or str(error)
    if errno_ == errno.EMFILE:
        return f"{cause}: the process has no file descriptor left, LimitNOFILE= too low or a descriptor leak"
    if errno_ == errno.ENFILE:
        return f"{cause}: the system has no file descriptor left (fs.file-max)"
    return f"{cause}: the system is short of memory"


def short_of(error: BaseException) -> bool:
    """Whether ``error`` says the process ran out of descriptors, memory or threads (`why` says which)."""
    return out_of_resources(error) or (isinstance(error, RuntimeError) and "can't start new thread" in str(error))


def out_of_resources(error: BaseException) -> bool:
    """Whether ``error`` (an OSError, or libzmq's `zmq.ZMQError`, which carries an errno too) is for want
    of a descriptor or memory: an accept failing so is not the client's fault."""
    return getattr(error, "errno", None) in OUT_OF_RESOURCES


def make_room(descriptors: int) -> None:
    """Raise EMFILE's `OSError` unless ``descriptors`` more can be opened now, so that a libzmq socket
    is made or bound only with room for the descriptors libzmq would otherwise abort without."""
    opened: list[int] = []
    try:
        for _ in range(descriptors):
            opened.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    finally:
        for fd in opened:
            os.close(fd)


class AcceptFailures:
    """One server's failed accepts (and connections it had no thread for): counted, said when they
    start and when a connection is taken again, each at most every `LOG_INTERVAL_S` (failures that
    come and go as a limit is reached and left say two lines a minute at most). Any thread."""

    def __init__(self, what: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.count = 0  # failed since start
        self._clock = clock
        self._lock = threading.Lock()
        self._failing = False
        self._said: dict[bool, float] = {}  # failing or not: when it was last said

    def _may_say(self, failing: bool, now: float) -> bool:
        if now - self._said.get(failing, now - LOG_INTERVAL_S) < LOG_INTERVAL_S:
            return False
        self._said[failing] = now
        return True

    def failed(self, error: BaseException) -> None:
        now = self._clock()
        with self._lock:
            self.count += 1
            count, self._failing = self.count, True
            if not self._may_say(True, now):
                return
        then = "it is closed" if isinstance(error, RuntimeError) else "it waits, with any after it, until there is room"
        log.error("%s: cannot take a connection (%s); %s (%d failed since start)", self.what, why(error), then, count)

    def accepted(self) -> None:
        """A connection was taken: a burst of failures before it has ended."""
        if not self._failing:  # the common case, without the lock
            return
        now = self._clock()
        with self._lock:
            ended, self._failing, count = self._failing, False, self.count
            say = ended and self._may_say(False, now)
        if say:
            log.info("%s: taking connections again (%d failed since start)", self.what, count)


def quiet_accept_failures(loop: asyncio.AbstractEventLoop, failures: AcceptFailures) -> None:
    """``loop``'s failed accepts counted in ``failures`` and said as it says them, not as asyncio's
    traceback per try; anything else goes to the loop's default handler as before."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if context.get("message") == ASYNCIO_ACCEPT_MESSAGE and error is not None and out_of_resources(error):
            failures.failed(error)
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
