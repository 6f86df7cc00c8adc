"""Wake-ups: one thread telling another, waiting in ``select``, that there is something for it.

Capture threads set the loop's on every hand-over (`edged.latest`) and lanes on every result
(`edged.lanes`); the loop waits on it together with the request sockets (`edged.trigger`), so
whichever comes first ends the wait. The MQTT thread waits on one beside the broker's socket
(`edged.mqtt`), and the trigger server's inbox hands requests to the loop with one. A socket
pair, rather than a `threading.Event`, is what a ``select`` can wait on beside other sockets.
"""

from __future__ import annotations

import contextlib
import select
import socket
from collections.abc import Sequence
from typing import Any, Protocol


class Waker(Protocol):
    """What a thread that has something for the loop calls: a `Wake`, or a `threading.Event`."""

    def set(self) -> None: ...


class Wake:
    """A flag other threads set and one thread waits on, alone or with sockets; cleared by that thread.

    `ready` and ``zmq.select`` take it as they take a socket (`fileno`).
    """

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def set(self) -> None:
        """Never blocks, and never fails: once closed it does nothing."""
        with contextlib.suppress(BlockingIOError, OSError):  # already set (the pair is full), or closed
            self._w.send(b"\0")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._r.recv(4096):
                pass

    def fileno(self) -> int:
        """Readable while set."""
        return self._r.fileno()

    def wait(self, timeout_s: float, sockets: Sequence[Any] = ()) -> None:
        """Until set, one of ``sockets`` (ZeroMQ sockets or file-like) is readable, or ``timeout_s``."""
        import zmq  # here only: the reject line's process waits with `ready` and never loads libzmq

        zmq.select([self._r, *sockets], [], [], max(0.0, timeout_s))

    def close(self) -> None:
        self._r.close()
        self._w.close()


# What poll reports that select would report as readable (or writable): data, or the end of the stream.
_IN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR | select.POLLNVAL
_OUT = select.POLLOUT | select.POLLHUP | select.POLLERR | select.POLLNVAL


def ready(read: Sequence[Any], write: Sequence[Any], timeout_s: float) -> tuple[list[Any], list[Any]]:
    """``select.select(read, write, [], timeout_s)``'s readable and writable, for a descriptor of any
    number. select takes none past 1023 (ValueError): a process the units let hold 16,384 (a flood of
    ZeroMQ subscribers is enough) makes its next socket one, and an MQTT reconnect, a live-view
    viewer or a reject line then failed. ``read`` and ``write`` hold descriptors or objects with ``fileno()``."""
    wanted: dict[int, int] = {}
    for things, mask in ((read, select.POLLIN), (write, select.POLLOUT)):
        for thing in things:
            wanted[_fd(thing)] = wanted.get(_fd(thing), 0) | mask
    poller = select.poll()
    for fd, mask in wanted.items():
        poller.register(fd, mask)
    events = dict(poller.poll(max(0.0, timeout_s) * 1000))
    return [t for t in read if events.get(_fd(t), 0) & _IN], [t for t in write if events.get(_fd(t), 0) & _OUT]


def _fd(thing: Any) -> int:
    return thing if isinstance(thing, int) else int(thing.fileno())
