"""The loop's wake-up: set by other threads, waited on alone or beside sockets."""

from __future__ import annotations

import os
import socket
import threading
import time

from edged.wake import Wake, ready


def test_a_set_wake_ends_the_wait_until_cleared_and_setting_it_often_never_blocks() -> None:
    wake = Wake()
    try:
        for _ in range(100_000):  # far beyond what the socket pair buffers: the extra sets are dropped
            wake.set()
        started = time.monotonic()
        wake.wait(60.0)
        assert time.monotonic() - started < 30  # it was set: the wait ended long before its timeout
        wake.clear()
        readable = []
        done = threading.Event()

        def waiter() -> None:
            wake.wait(60.0)
            readable.append(True)
            done.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        assert not done.wait(0.2)  # cleared: the wait waits
        wake.set()  # as a capture thread's hand-over does
        assert done.wait(30) and readable == [True]
        thread.join(30)
    finally:
        wake.close()


def test_a_readable_socket_beside_it_ends_the_wait_too() -> None:
    wake = Wake()
    a, b = socket.socketpair()
    try:
        done = threading.Event()
        thread = threading.Thread(target=lambda: (wake.wait(60.0, [a]), done.set()))
        thread.start()
        b.send(b"request")  # as a trigger request arriving
        assert done.wait(30)
        thread.join(30)
    finally:
        wake.close()
        a.close()
        b.close()


def test_ready_takes_descriptors_select_cannot() -> None:
    """select() refuses a descriptor past 1023; the units let edged hold 16,384."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    a, b = socket.socketpair()
    try:
        r, w = os.pipe()
        assert min(a.fileno(), b.fileno(), r, w) > 1023
        assert ready([a, r], [b], 0) == ([], [b])  # nothing to read yet; a socket with room is writable
        b.send(b"x")
        os.write(w, b"x")
        assert ready([a, r], [], 1.0) == ([a, r], [])
        b.close()
        a.recv(1)
        assert ready([a], [], 1.0) == ([a], [])  # the peer gone: readable, as select says, reading finds the end
        os.close(r)
        os.close(w)
    finally:
        a.close()
        for fd in held:
            os.close(fd)
