"""The HTTP server: a live view, a status page, Prometheus metrics and a health check, for people.

Served by the daemon itself on ``http.listen`` (loopback by default) with the standard library's
threading server (`edged.http_server`): one thread per request, a bounded number of connections
(in all and per client address), a deadline for the whole request header, and stream viewers
that stop reading dropped after ``send_timeout_s``. Nothing here slows the loop: each camera has
a `LiveView` of its own, the loop offers a camera's frames to it only while someone watches that
camera, hands over the status once per status interval, and never waits for a client.

Endpoints: ``/`` (the page), ``/stream.mjpg`` (multipart JPEG), ``/snapshot.jpg``,
``/status.json`` (the last status message), ``/verdicts.json`` (the latest verdicts, with
``[inspect]``), each of the first camera or, with ``?camera=ID``, of that one; ``/cameras.json``
(every camera's state and verdicts at a glance), ``/metrics`` and ``/healthz``; GET, or HEAD for
the headers alone. On anything but loopback a bearer token is required (``http.token_file``), as
``Authorization: Bearer`` or ``?token=`` (a browser's only way for an image).

A listen address that cannot be bound (the port is taken by another instance, the address is not
up yet) does not stop the daemon: detections are what the line depends on. It is logged and
retried every `BIND_RETRY_S`.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edged.accept import AcceptFailures
from edged.errors import EdgedError, KeyFileError
from edged.keys import read_token
from edged.listen import BIND_RETRY_S, listen_tcp
from edged.messages import DetectionsMessage, StatusMessage
from edged.output import Delivery, Endpoint, FrameReport, Output, Services, StatusReport
from edged.settings.endpoints import host_port
from edged.settings.http import HttpConfig, is_loopback, listen_address
from edged.settings.inspect import Point
from edged.sources.base import Frame
from edged.stats import VerdictCounts
from edged.view import LiveView

if TYPE_CHECKING:
    from edged.config import Settings
    from edged.http_server import Server
    from edged.journal import JournalOutput
    from edged.prometheus import CameraStatus

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0  # a client that has not sent its whole request header in this time is dropped
REFUSAL_LOG_INTERVAL_S = 60.0
# Why a connection or request was refused (``edged_http_refused_total{reason}``).
REFUSALS = ("busy", "per_client", "header_timeout", "header_evicted", "header_too_large", "host", "max_viewers")
OUT_OF_RESOURCES = "out_of_resources"  # not a refusal as those: the client waits in the listen backlog

CameraZones = Mapping[str, Mapping[str, Sequence[Point]]]  # camera id -> the zones its view draws


class HttpServer(Output):
    """The server of one configuration, which has a listen address (`from_settings` makes none
    without); `start` binds it in the background, `close` stops it."""

    def __init__(
        self,
        cfg: HttpConfig,
        health: Callable[[], str | None],
        cameras: CameraZones,
        *,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        """``cameras``: each camera's id with the zones its live view draws, the one shown by default
        first; ``request_timeout_s``: the time a client has to send its whole request header."""
        self.cfg = cfg
        self.request_timeout_s = request_timeout_s
        self.allowed_hosts = set(cfg.allowed_hosts)
        if not is_loopback(listen_address(cfg.listen)[0]):
            board = socket.gethostname().lower()
            self.allowed_hosts |= {board, f"{board}.local"}
        self.health = health
        from edged.prometheus import Metrics  # prometheus_client only with the live view on (`edged.http_server`)

        self.metrics = Metrics(refused=self.refusals)
        self.token = read_token(cfg.token_file, "http.token_file") if cfg.token_file else None
        # By camera: its status and verdicts (None without [inspect]) as last published.
        self.reports: Mapping[str, tuple[StatusMessage, VerdictCounts | None]] = {}
        self.views: Mapping[str, LiveView] = {}  # by camera, in configuration order: replaced whole, never changed
        self.journal: Path | None = None  # the verdict journal `/history.json` reads; None when it is off
        self._started = False
        self._lock = threading.Lock()
        self._counts = threading.Lock()  # guards the viewers admitted and the refusals
        self._viewers = 0
        self._refused = dict.fromkeys(REFUSALS, 0)
        self._refusal_logged = -REFUSAL_LOG_INTERVAL_S  # monotonic time of the last refusal logged
        self._stopping = threading.Event()
        self.accept_failures = AcceptFailures("http")  # connections it had no descriptor or thread for
        self._waker: socket.socket | None = None  # wakes the serving thread's poll for a stop
        self._thread = threading.Thread(target=self._serve, name="edged-http", daemon=True)
        self.follow_cameras(cameras)

    # ---- as an output (`edged.output`) --------------------------------------------------------

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> HttpServer | None:
        if not settings.http.listen:  # off: nothing of the server loads (`edged.http_server`)
            return None
        server = cls(settings.http, services.health, settings.camera_zones())
        server.start()
        return server

    @classmethod
    def listening(cls, settings: Settings) -> list[Endpoint]:
        listen = settings.http.listen
        return [Endpoint("http.listen", url_of(listen), partial(_try_listen, listen))] if listen else []

    def wants(self, camera_id: str, found: bool) -> Delivery:
        return Delivery.SHOWN if self.wants_frame(camera_id) else Delivery.NONE

    def use_journal(self, journal: JournalOutput | None) -> None:
        self.journal = journal.path if journal is not None else None

    def frame(self, report: FrameReport) -> None:
        if report.message is not None and self.wants_frame(report.camera_id):
            self.offer(report.camera_id, report.outcome.frame, report.message, report.outcome.result.heatmap())

    def previews(self, camera_id: str) -> bool:
        return self.wants_frame(camera_id)

    def preview(self, camera_id: str, frame: Frame) -> None:
        self.offer(camera_id, frame, None)

    def status(self, reports: Sequence[StatusReport]) -> None:
        self.update([report.status for report in reports])

    def reload(self, settings: Settings, services: Services) -> HttpServer | None:
        """The same ``[http]`` keeps this server (the token re-read, the cameras followed); other
        settings get a new server, which binds once this one has let go of its address; an empty
        ``http.listen`` none."""
        if settings.http == self.cfg:
            try:
                self.reload_token()
            except KeyFileError as e:
                log.error("http token not reloaded, the previous one stays: %s", e)
            self.follow_cameras(settings.camera_zones())
            return self
        if not settings.http.listen:
            self.close()
            return None
        try:
            server = HttpServer(settings.http, services.health, settings.camera_zones())
        except EdgedError as e:  # the token file went between the check and here
            log.error("live view settings not applied, the running server stays: %s", e)
            return self
        self.close()
        server.start()
        return server

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def start(self) -> None:
        self._started = True
        for view in self.views.values():
            view.start()
        self._thread.start()

    def follow_cameras(self, cameras: CameraZones) -> None:
        """The cameras of the running configuration, each with the zones to draw from its next frame
        on: a camera a reload adds gets a view, one it removes has its view closed, which ends its
        streams."""
        views: dict[str, LiveView] = {}
        for camera, zones in cameras.items():
            view = self.views.get(camera)
            if view is None:
                view = LiveView(camera, self.cfg.view_fps, self.cfg.view_width, self.cfg.jpeg_quality, zones)
                if self._started:
                    view.start()
            else:
                view.show_zones(zones)
            views[camera] = view
        old, self.views = self.views, views
        for camera, view in old.items():
            if camera not in views:
                view.close()

    def wants_frame(self, camera: str) -> bool:
        """True when a frame of ``camera`` offered now would be shown (`LiveView.wants_frame`): no allocation."""
        view = self.views.get(camera)
        return view is not None and view.wants_frame()

    def offer(self, camera: str, frame: Frame, message: DetectionsMessage | None, heatmap: np.ndarray | None = None) -> None:
        """Copy ``frame`` to ``camera``'s view (``message`` None: a preview, shown unannotated), with
        ``heatmap`` overlaid when given; call only right after `wants_frame` said yes."""
        self.views[camera].offer(frame, message, heatmap)

    def reload_token(self) -> None:
        """SIGHUP: read the token file again (a rotated token); raises KeyFileError, keeping the old one."""
        if self.cfg.token_file is not None:
            self.token = read_token(self.cfg.token_file, "http.token_file")

    @contextlib.contextmanager
    def viewer(self) -> Iterator[bool]:
        """A stream's place among ``max_viewers`` for as long as the block runs: True when admitted.

        Checked and taken under one lock: viewers that arrive together cannot all pass the check
        before any is counted, so streams never take the connections kept for everything else."""
        with self._counts:
            admitted = self._viewers < self.cfg.max_viewers
            if admitted:
                self._viewers += 1
        try:
            yield admitted
        finally:
            if admitted:
                with self._counts:
                    self._viewers -= 1

    def refuse(self, reason: str, client: str) -> None:
        """Count a connection or request refused for ``reason`` (one of `REFUSALS`); the journal gets
        a line at most every `REFUSAL_LOG_INTERVAL_S`, with the counts, so a flood cannot flood it."""
        now = time.monotonic()
        with self._counts:
            self._refused[reason] += 1
            if now - self._refusal_logged < REFUSAL_LOG_INTERVAL_S:
                return
            self._refusal_logged = now
            counts = ", ".join(f"{n} {why}" for why, n in self._refused.items() if n)
        log.warning("http: refused %s from %s (since start: %s)", reason, client, counts)

    def refusals(self) -> Mapping[str, int]:
        """Connections and requests refused since start, by reason (`REFUSALS`), and the connections
        not taken for want of a descriptor, memory or a thread (`edged.accept.AcceptFailures`)."""
        with self._counts:
            return {**self._refused, OUT_OF_RESOURCES: self.accept_failures.count}

    def update(self, cameras: Sequence[CameraStatus]) -> None:
        """Each camera's status just published, with its stage histograms and verdicts (None without
        ``[inspect]``) as they were then."""
        self.reports = {status.camera_id: (status, verdicts) for status, _, verdicts in cameras}
        self.metrics.update(cameras)

    def close(self) -> None:
        with self._lock:
            self._stopping.set()
            if self._waker is not None:
                self._waker.send(b"\0")
        for view in self.views.values():
            view.close()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _serve(self) -> None:
        from edged.http_server import Server

        host, port = listen_address(self.cfg.listen)
        failures = 0
        while not self._stopping.is_set():
            try:
                server = Server((host, port), self)
                wake, waker = _socketpair(server)
            except OSError as e:
                if failures == 0:
                    log.error(
                        "http.listen %s: cannot serve the live view, status page and metrics (%s); detection "
                        "goes on without them, retrying every %.0f s (an instance beside this one needs an "
                        "http.listen of its own)",
                        self.cfg.listen,
                        e.strerror or e,
                        BIND_RETRY_S,
                    )
                failures += 1
                self._stopping.wait(BIND_RETRY_S)
                continue
            with server, wake, waker:
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self._waker = waker
                log.info("live view, status page and metrics on %s", url_of(self.cfg.listen))
                try:
                    self._accept(server, wake)
                finally:
                    with self._lock:
                        self._waker = None
            return

    def _accept(self, server: Server, wake: socket.socket) -> None:
        """Serves until `close` wakes the poll. `serve_forever` looks at its stop only between polls,
        so a stop, and a reload that replaces the server, waited up to its poll interval (0.5 s)."""
        server.timeout = 0  # `handle_request` waits for no connection: one reset before its accept is gone
        with selectors.PollSelector() as selector:  # no descriptor of its own, as `serve_forever`
            selector.register(server, selectors.EVENT_READ)
            selector.register(wake, selectors.EVENT_READ)
            while not self._stopping.is_set():
                if any(key.fileobj is server for key, _ in selector.select()):
                    server.handle_request()


def _socketpair(server: Server) -> tuple[socket.socket, socket.socket]:
    """The pair that wakes the serving thread; where no descriptor is left for it, the server is closed
    and the OSError raised, as a failed bind."""
    try:
        return socket.socketpair()
    except OSError:
        server.server_close()
        raise


def url_of(listen: str) -> str:
    """The live view's address as a browser takes it: an IPv6 address in brackets, written with them or not."""
    return f"http://{host_port(*listen_address(listen))}/"


def _try_listen(listen: str) -> Callable[[], None]:
    """`Endpoint.bind` of ``http.listen``: bound and listening as `edged.http_server.Server` binds, then released.
    Raises `BindError`: `run` would serve nothing there."""
    host, port = listen_address(listen)
    what = "the live view, status page and metrics cannot be served there"
    return listen_tcp("http.listen", listen, host, port, what).close
