"""A flood for tests: DEALER clients sending one request to a socket as fast as libzmq takes it,
reading no answer, as a runaway or hostile client would."""

from __future__ import annotations

import threading

import zmq


class Flood:
    """``clients`` DEALER sockets on ``endpoint`` sending ``payload`` (after the empty delimiter a REQ
    would put) without pause, on a thread of their own, from ``with`` until its end; ``sent`` counts
    the requests libzmq took."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, payload: bytes, clients: int = 4) -> None:
        self.sent = 0
        self._context, self._endpoint, self._payload, self._clients = context, endpoint, payload, clients
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flood, daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _flood(self) -> None:
        socks = [self._context.socket(zmq.DEALER) for _ in range(self._clients)]
        for sock in socks:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)  # always more waiting than the daemon reads in a turn
            sock.connect(self._endpoint)
        while not self._stop.is_set():
            for sock in socks:
                try:
                    sock.send_multipart([b"", self._payload], zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:
                    self._stop.wait(0.001)
        for sock in socks:
            sock.close(linger=0)
