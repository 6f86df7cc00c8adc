"""The request side of `edged.http`: the standard library's threading server with its bounds, and
the handler that answers each request from the state `edged.http.HttpServer` keeps.

A module of its own so that ``http.server`` and ``prometheus_client`` load only when the live view
is on (`HttpServer` imports it as it starts serving): a daemon or `edged check` with
``http.listen = ""`` starts without them.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Mapping, Set
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote_plus, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from edged import history
from edged.accept import ACCEPT_RETRY_S, out_of_resources
from edged.errors import JournalUnreadable, UsageError
from edged.listen import dual_stack, every_address
from edged.settings.http import MAX_CONNECTIONS
from edged.view import LiveView
from edged.wake import ready

if TYPE_CHECKING:
    from edged.http import HttpServer

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 10.0  # for sending an answer
MAX_HEADER_BYTES = 16 * 1024
EVICTING_AT_ONCE = 4  # connections given up for newer ones whose threads may still be ending
SNAPSHOT_WAIT_S = 5.0
HISTORY_LIMIT = 1000  # the most journal entries one /history.json answer holds
STREAM_SEND_BUFFER = 256 * 1024  # bytes queued in the kernel per viewer (Linux doubles it): a few frames
BOUNDARY = "frame"


def answers_to(allowed_hosts: Set[str], host: str, local_address: str) -> bool:
    """True when a request whose Host header is ``host`` (empty when it has none), received on
    ``local_address``, is answered.

    A web page whose own name an attacker rebinds to the board's address sends that name as
    Host: it is answered only when it is a loopback name and the request came in on loopback,
    the very address the request was sent to, or one of ``allowed_hosts`` (`HttpServer.allowed_hosts`:
    ``http.allowed_hosts`` and, on a network listen, the board's host name). A request without
    Host is no browser's, so there is nothing to rebind."""
    if not host:
        return True
    name = _host_name(host)
    address = _address(name)
    if name in allowed_hosts or (address is not None and str(address) in allowed_hosts):
        return True
    local = _address(local_address)
    if name == "localhost" or (address is not None and address.is_loopback):
        return local is not None and local.is_loopback
    return address is not None and address == local


def _host_name(host: str) -> str:
    """The name or address of a Host header, without its port, brackets or final dot, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, colon, port = host.rpartition(":")
    if colon and ":" not in name and port.isdigit():
        host = name
    return host.removesuffix(".")


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``text`` spells (an IPv4-mapped IPv6 one as IPv4), or None for a name."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _mask_token(text: str) -> str:
    """``text`` with the value of every ``token`` query parameter (however its name is percent-encoded)
    replaced by ``***``."""

    def mask(match: re.Match[str]) -> str:
        return f"{match[1]}***" if unquote_plus(match[2]) == "token" else match[0]

    return _QUERY_PARAMETER.sub(mask, text)


# A name ends at the next ``?`` too, so each place in the line is tried once: a name that ran on over
# ``?`` made a request line of 16 KB of them cost seconds of CPU, the GIL held and the loop with it.
_QUERY_PARAMETER = re.compile(r"([?&;]([^=&;?\s'\"]*)=)[^&;\s'\"]*")


class Server(ThreadingHTTPServer):
    """Bounded connections: `MAX_CONNECTIONS` in all and ``max_connections_per_client`` per address.

    A connection still sending its request header holds a slot only until one is needed: at a
    limit, the oldest such connection (of that address, at its limit) is closed for the newcomer.
    So connections that trickle their header (a slowloris) cannot keep `/healthz` or `/metrics`
    from being answered, whatever addresses they come from; connections beyond the limits that
    requests being served hold are closed at accept. The threads stay bounded: at most
    `EVICTING_AT_ONCE` closed connections may still be ending beside the limit.
    """

    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], owner: HttpServer) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._per_client: Counter[str] = Counter()  # connections held, by address (not counting evicted ones)
        self._waiting: dict[Any, str] = {}  # connections yet to send their whole header, oldest first: address
        self._evicted: set[Any] = set()  # connections closed for newer ones, their threads not yet ended
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        if every_address(str(self.server_address[0])):  # IPv4 viewers too, whatever the system's bindv6only
            dual_stack(self.socket)
        super().server_bind()

    def get_request(self) -> tuple[Any, Any]:
        """The next connection; where the process has no descriptor for it (EMFILE), the failure is said
        (`edged.accept.AcceptFailures`) and the thread pauses before the next try: the listening
        socket stays readable meanwhile, and returning at once to the poll spun a core."""
        try:
            accepted = super().get_request()
        except OSError as e:
            if out_of_resources(e):
                self.owner.accept_failures.failed(e)
                time.sleep(ACCEPT_RETRY_S)  # the poll (`HttpServer._accept`) goes on; a stop waits this long at most
            raise
        return accepted

    def process_request(self, request: Any, client_address: Any) -> None:
        client = client_address[0]
        with self._lock:
            refused = self._admit(client)
            if refused is None:
                self._per_client[client] += 1
                self._waiting[request] = client
        if refused is not None:
            self.owner.accept_failures.accepted()
            self.owner.refuse(refused, client)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except RuntimeError as e:  # no thread for it (TasksMax=): closed, and said once a burst, not a traceback each
            self._release(request, client)
            self.owner.accept_failures.failed(e)
            self.shutdown_request(request)
        except BaseException:
            self._release(request, client)
            raise
        else:
            self.owner.accept_failures.accepted()

    def _admit(self, client: str) -> str | None:
        """None when a connection from ``client`` may be served, after evicting the oldest connection
        still sending its header if a limit is reached; else the reason it is refused."""
        over_client = self._per_client[client] >= self.owner.cfg.max_connections_per_client
        if not over_client and self._per_client.total() < MAX_CONNECTIONS:
            return None
        reason = "per_client" if over_client else "busy"
        if len(self._evicted) >= EVICTING_AT_ONCE:
            return reason
        oldest = next((sock for sock, owner in self._waiting.items() if owner == client or not over_client), None)
        if oldest is None:
            return reason
        evicted = self._waiting.pop(oldest)
        self._leaves(evicted)
        self._evicted.add(oldest)
        with contextlib.suppress(OSError):  # its thread's read ends at once, and the thread with it
            oldest.shutdown(socket.SHUT_RDWR)
        self.owner.refuse("header_evicted", evicted)
        return None

    def header_received(self, request: Any) -> bool:
        """Called once a connection's whole header is in: it is no longer evicted for a newcomer.
        False when it already was (its request is not to be answered)."""
        with self._lock:
            return self._waiting.pop(request, None) is not None

    def _release(self, request: Any, client: str) -> None:
        with self._lock:
            if request in self._evicted:
                self._evicted.discard(request)
                return
            self._waiting.pop(request, None)
            self._leaves(client)

    def _leaves(self, client: str) -> None:
        """One connection of ``client`` fewer (an address without any is forgotten, so the map stays small)."""
        self._per_client[client] -= 1
        if not self._per_client[client]:
            del self._per_client[client]

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request, client_address[0])

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A request that failed in edged's own code: logged with its traceback, as every other fault
        is, not printed on stderr as the standard library does."""
        log.error("http: answering %s failed", client_address[0], exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: Server
    timeout = ANSWER_TIMEOUT_S  # the header has `HttpServer.request_timeout_s` in all
    server_version = "edged"
    protocol_version = "HTTP/1.0"

    def handle(self) -> None:
        """One request (HTTP/1.0), parsed once its whole header is in."""
        header = self._read_header()
        if header is not None and self.server.header_received(self.connection):
            self.rfile.close()  # the socket's reader: nothing more is read from the connection
            self.rfile = io.BytesIO(header)
            self.connection.settimeout(self.timeout)
            try:
                self.handle_one_request()
            except ConnectionError as e:  # the client closed or reset its end: nothing is wrong here
                log.debug("http %s: left before its answer was sent (%s)", self.address_string(), e.strerror or e)

    def _read_header(self) -> bytes | None:
        """The request line and headers, or None (counted) when they are not all in within
        ``request_timeout_s`` of the connection, however they trickle, or are larger than
        `MAX_HEADER_BYTES`; None too when the connection was closed, by the client or for a newcomer."""
        owner = self.server.owner
        deadline = time.monotonic() + owner.request_timeout_s
        header = bytearray()
        while b"\r\n\r\n" not in header and b"\n\n" not in header and len(header) <= MAX_HEADER_BYTES:
            self.connection.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                chunk = self.connection.recv(4096)
            except TimeoutError:
                owner.refuse("header_timeout", self.client_address[0])
                return None
            except OSError:
                return None
            if not chunk:
                return None
            header += chunk
        if len(header) > MAX_HEADER_BYTES:
            owner.refuse("header_too_large", self.client_address[0])
            with contextlib.suppress(OSError):
                self.connection.sendall(
                    b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Type: text/plain\r\n\r\n"
                    b"the request header is larger than %d bytes\n" % MAX_HEADER_BYTES
                )
            return None
        return bytes(header)

    def do_HEAD(self) -> None:
        """What GET answers, without its body (RFC 9110 asks every server for HEAD): health checks
        such as ``curl -I`` and load balancers' probes use it."""
        self.do_GET()

    def do_GET(self) -> None:
        owner = self.server.owner
        host = self.headers.get("Host", "")
        if not answers_to(owner.allowed_hosts, host, self.connection.getsockname()[0]):
            owner.refuse("host", self.client_address[0])
            self._send(
                421,
                f"this server does not answer to the name {_host_name(host)!r}: add it to http.allowed_hosts, "
                "or use the board's address (names not allowed are refused against DNS rebinding)\n".encode(),
            )
            return
        url = urlsplit(self.path)
        params = parse_qs(url.query)
        if owner.token is not None and not self._authorised(owner.token, params):
            self._send(
                401,
                b"a valid token is needed: Authorization: Bearer TOKEN, or ?token=TOKEN\n",
                "text/plain",
                {"WWW-Authenticate": 'Bearer realm="edged"'},
            )
            return
        of_camera = {
            "/": self._page,
            "/stream.mjpg": self._stream,
            "/snapshot.jpg": self._snapshot,
            "/status.json": self._status,
            "/verdicts.json": self._verdicts,
        }.get(url.path)
        if of_camera is not None:
            shown = self._camera(owner, params.get("camera", [None])[0], as_json=url.path.endswith(".json"))
            if shown is not None:
                of_camera(owner, *shown)
            return
        if url.path == "/history.json":
            self._history(owner, {key: values[0] for key, values in params.items()})
            return
        of_all = {"/cameras.json": self._cameras, "/metrics": self._metrics, "/healthz": self._healthz}.get(url.path)
        if of_all is None:
            self._send(
                404,
                b"not found: try /, /stream.mjpg, /snapshot.jpg, /status.json, /verdicts.json (each with ?camera=ID), "
                b"/cameras.json, /history.json, /metrics or /healthz\n",
            )
            return
        of_all(owner)

    def _authorised(self, token: str, params: Mapping[str, list[str]]) -> bool:
        given = ""
        scheme, _, credentials = self.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer":  # schemes are case-insensitive (RFC 7235)
            given = credentials.strip()
        elif "token" in params:
            given = params["token"][0]
        return hmac.compare_digest(given.encode(), token.encode())

    def _camera(self, owner: HttpServer, wanted: str | None, *, as_json: bool) -> tuple[str, LiveView] | None:
        """The camera ``?camera=`` names, or the first without it, with its view; None once an
        unknown one has been answered with a 404 naming the cameras."""
        views = owner.views
        camera = next(iter(views), "") if wanted is None else wanted
        view = views.get(camera)
        if view is not None:
            return camera, view
        error = f"no camera {camera!r}: cameras are {', '.join(views)}"
        if as_json:
            self._send(404, json.dumps({"error": error}).encode(), "application/json")
        else:
            self._send(404, f"{error}\n".encode())
        return None

    def _send(
        self,
        code: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _page(self, owner: HttpServer, camera: str, view: LiveView) -> None:
        """The page is the same for every camera: its script reads ``?camera=`` (and ``?token=``) from its address."""
        self._send(200, PAGE, "text/html; charset=utf-8")

    def _status(self, owner: HttpServer, camera: str, view: LiveView) -> None:
        report = owner.reports.get(camera)
        if report is None:
            self._send(503, b'{"error": "no status yet"}\n', "application/json")
            return
        self._send(200, report[0].model_dump_json().encode(), "application/json")

    def _verdicts(self, owner: HttpServer, camera: str, view: LiveView) -> None:
        report = owner.reports.get(camera)
        if report is None:
            self._send(503, b'{"error": "no status yet"}\n', "application/json")
            return
        verdicts = report[1]
        if verdicts is None:
            self._send(404, b'{"error": "no verdicts: [inspect] is not configured"}\n', "application/json")
            return
        latest = [
            {
                "capture_time_ms": v.capture_time_ns / 1e6,
                "frame_id": v.frame_id,
                "part_id": v.part_id,
                "verdict": v.verdict,
                "reasons": [r.model_dump() for r in v.reasons],
            }
            for v in verdicts.latest
        ]
        body: dict[str, object] = {str(verdict): count for verdict, count in verdicts.verdicts.items()}
        body["latest"] = latest
        self._send(200, json.dumps(body).encode(), "application/json")

    def _cameras(self, owner: HttpServer) -> None:
        """Every camera at a glance, in configuration order: its state, rate and, with ``[inspect]``,
        its verdicts since start and its latest one (null before its first status or verdict)."""
        reports = owner.reports
        cameras = []
        for camera in owner.views:
            status, verdicts = reports.get(camera, (None, None))
            cameras.append(
                {
                    "camera_id": camera,
                    "source_state": status.source_state if status else "starting",
                    "fps": status.fps if status else None,
                    "ok": verdicts.verdicts["ok"] if verdicts else None,
                    "ng": verdicts.verdicts["ng"] if verdicts else None,
                    "uncertain": verdicts.verdicts["uncertain"] if verdicts else None,
                    "verdict": verdicts.latest[0].verdict if verdicts and verdicts.latest else None,
                }
            )
        self._send(200, json.dumps({"cameras": cameras}).encode(), "application/json")

    def _history(self, owner: HttpServer, params: Mapping[str, str]) -> None:
        """The journal's entries as `edged history --json` gives them, its filters as parameters:
        ``part_id``, ``camera``, ``since``, ``until``, ``verdict``, ``detections=1``, ``limit`` (at most
        `HISTORY_LIMIT`)."""
        if owner.journal is None:
            self._send(404, b'{"error": "the journal is off: [journal] enabled = false"}\n', "application/json")
            return
        try:
            limit = int(params.get("limit", "100"))
            if not 1 <= limit <= HISTORY_LIMIT:
                raise ValueError
        except ValueError:
            self._send(400, json.dumps({"error": f"limit: a number from 1 to {HISTORY_LIMIT}"}).encode(), "application/json")
            return
        try:
            query = history.Query.parse(
                part_id=params.get("part_id"),
                camera_id=params.get("camera"),
                since=params.get("since"),
                until=params.get("until"),
                verdict=params.get("verdict"),
                detections=params.get("detections") in ("1", "true"),
                limit=limit,
            )
            rows = [history.record(row) for row in history.entries(owner.journal, query)]  # at most HISTORY_LIMIT
        except UsageError as e:
            self._send(400, json.dumps({"error": str(e)}).encode(), "application/json")
            return
        except JournalUnreadable as e:
            self._send(503, json.dumps({"error": str(e)}).encode(), "application/json")
            return
        self._send(200, json.dumps(rows, default=str).encode(), "application/json")  # str: a BLOB put in by hand

    def _metrics(self, owner: HttpServer) -> None:
        self._send(200, owner.metrics.exposition(), CONTENT_TYPE_LATEST)

    def _healthz(self, owner: HttpServer) -> None:
        problem = owner.health()
        if problem is None:
            self._send(200, b"ok\n")
        else:
            self._send(503, f"{problem}\n".encode())

    def _snapshot(self, owner: HttpServer, camera: str, view: LiveView) -> None:
        """The next frame encoded, or the latest at once while someone else watches (`LiveView.start_seq`).
        Waiting for it, the request is a viewer like a stream, among
        ``max_viewers``: snapshots of a camera that delivers nothing wait their whole
        `SNAPSHOT_WAIT_S`, and without the bound a few pollers took every connection, `/healthz` too."""
        with owner.viewer() as admitted:
            if not admitted:
                self._too_many_viewers(owner)
                return
            start = view.start_seq()
            with view.watch():
                got = view.next_jpeg(start, SNAPSHOT_WAIT_S)
        if got is None and view.closed:
            self._send(404, f"camera {camera!r} is no longer configured\n".encode())
            return
        if got is None:
            report = owner.reports.get(camera)
            state = report[0].source_state if report else "starting"
            self._send(503, f"no frame processed within {SNAPSHOT_WAIT_S:.0f} s (camera {camera} {state})\n".encode())
            return
        self._send(200, got[1], "image/jpeg")

    def _stream(self, owner: HttpServer, camera: str, view: LiveView) -> None:
        with owner.viewer() as admitted:
            if admitted:
                self._stream_to(owner, view)
                return
        self._too_many_viewers(owner)

    def _too_many_viewers(self, owner: HttpServer) -> None:
        owner.refuse("max_viewers", self.client_address[0])
        self._send(
            503,
            f"already {owner.cfg.max_viewers} viewers, the most http.max_viewers allows: try again later\n".encode(),
            headers={"Retry-After": "5"},
        )

    def _stream_to(self, owner: HttpServer, view: LiveView) -> None:
        # A viewer that stops reading fills this buffer, then is dropped after send_timeout_s.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
        self.connection.settimeout(owner.cfg.send_timeout_s)
        self.send_response(200)
        self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command == "HEAD":
            return
        # Each part goes with the delimiter after it: a browser shows a part once it sees that, so sent
        # before the next part, every frame was shown only when the next came (seconds, from a slow camera).
        delimiter = f"\r\n--{BOUNDARY}".encode()
        seq = view.start_seq()
        with view.watch():
            try:
                self.wfile.write(delimiter[2:])  # the first needs no line break before it
            except OSError:
                return
            while not (owner.stopping or view.closed):
                got = view.next_jpeg(seq, 1.0)
                if got is None:
                    if self._client_gone():  # no frames (camera lost): notice a viewer that left
                        return
                    continue
                seq, jpeg = got
                head = f"\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n".encode()
                try:
                    self.wfile.write(head + jpeg + delimiter)
                except OSError:  # gone, or stopped reading for send_timeout_s
                    return
        with contextlib.suppress(OSError):  # a reload removed the camera, or the server stops: the delimiter closes
            self.wfile.write(b"--\r\n")

    def _client_gone(self) -> bool:
        """True when the viewer has closed its end (readable, and reading finds the end of the stream)."""
        readable, _ = ready([self.connection], [], 0)
        if not readable:
            return False
        try:
            peeked: bytes = self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True
        return peeked == b""

    def log_message(self, format: str, *args: Any) -> None:
        """Every line the request path logs (request lines, refusals), at debug level: the token masked,
        as RTSP passwords are. The line is made and masked only when debug lines are logged: each
        request's line is up to 16 KiB of a client's choosing."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("http %s: %s", self.address_string(), _mask_token(format % args))


PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>edged</title>
<style>
body{margin:0;font:14px/1.4 system-ui,sans-serif;background:#16181c;color:#e6e6e6}
header{padding:8px 14px;background:#22262d;display:flex;gap:12px;align-items:center}
header b{font-size:16px}.pill{padding:1px 8px;border-radius:9px;background:#555}
.ok{background:#1f7a3a}.bad{background:#a12b2b}.warn{background:#a67a12}
main{display:flex;flex-wrap:wrap;align-items:flex-start;gap:14px;padding:14px}
#live{width:640px;max-width:100%;max-height:calc(100vh - 70px);background:#000;min-height:200px;object-fit:contain}
section{flex:0 1 300px;min-width:300px}#verdicts td{vertical-align:top}table{border-collapse:collapse;margin-bottom:12px}
td,th{padding:2px 10px 2px 0;text-align:left;font-variant-numeric:tabular-nums}th{color:#9aa;white-space:nowrap}
h2{font-size:13px;margin:6px 0;color:#9aa;text-transform:uppercase}
nav{display:flex;flex-wrap:wrap;gap:6px}nav a{color:inherit;text-decoration:none;border:2px solid transparent}
nav a.shown{border-color:#e6e6e6;font-weight:bold}
</style></head><body>
<header><b>edged</b><nav id="cameras" hidden></nav><span id="camera">&nbsp;</span>
<span id="state" class="pill">connecting</span><span id="health" class="pill">&nbsp;</span></header>
<main><img id="live" alt="live view">
<section>
<table>
<tr><th>fps</th><td id="fps">-</td></tr>
<tr><th>frame age</th><td id="age">-</td></tr>
<tr><th>rate cap</th><td id="cap">-</td></tr>
<tr><th>thermal</th><td id="thermal">-</td></tr>
<tr><th>frames</th><td id="frames">-</td></tr>
<tr><th>model</th><td id="model">-</td></tr>
<tr><th>uptime</th><td id="uptime">-</td></tr>
<tr id="opcua-row" hidden><th>OPC UA</th><td id="opcua">-</td></tr>
<tr id="modbus-row" hidden><th>modbus</th><td id="modbus">-</td></tr>
</table>
<h2>latency, ms</h2><table id="latency"></table>
<h2>drops</h2><table id="drops"></table>
<div id="inspect" hidden><h2>verdicts <span id="tally"></span></h2><table id="verdicts"></table></div>
<div id="reject" hidden><h2>reject line</h2><table id="rejects"></table></div>
<div id="candidate" hidden><h2>candidate <span id="trial"></span></h2><table id="trialrows"></table>
<table id="trialclasses"></table></div>
</section></main>
<script>
"use strict";
const q = location.search;
const params = new URLSearchParams(q);
const $ = (id) => document.getElementById(id);
$("live").src = "stream.mjpg" + q;
function rows(id, entries) {
  $(id).replaceChildren(...entries.map(([k, ...vs]) => {
    const tr = document.createElement("tr");
    for (const v of [k, ...vs]) { const td = document.createElement("td"); td.textContent = v; tr.append(td); }
    return tr;
  }));
}
function pill(id, text, kind) { const e = $(id); e.textContent = text; e.className = "pill " + kind; }
function clock(ms) { return new Date(ms).toLocaleTimeString([], {hour12: false}); }
async function verdicts() {
  const r = await fetch("verdicts.json" + q, {cache: "no-store"});
  $("inspect").hidden = !r.ok;
  if (!r.ok) return;
  const v = await r.json();
  $("tally").textContent = "(ok " + v.ok + ", ng " + v.ng + ")";
  const reason = (x) => x.label + (x.zone ? "@" + x.zone : "") + " " + x.score.toFixed(2);
  rows("verdicts", [["time", "frame / part", "verdict", "reasons"], ...v.latest.map((e) => [
    clock(e.capture_time_ms), e.part_id === null ? String(e.frame_id) : e.part_id,
    e.verdict.toUpperCase(), e.reasons.map(reason).join(", ")])]);
  for (const tr of $("verdicts").rows) {
    const cell = tr.cells[2], kind = {OK: "ok", NG: "bad"}[cell.textContent];
    if (kind) cell.className = kind;
  }
}
function candidate(c) {
  $("candidate").hidden = !c;
  if (!c) return;
  $("trial").textContent = "(" + c.state + (c.model ? " " + c.model.name : "") + ")";
  const pct = (x) => x === null ? "-" : (100 * x).toFixed(1) + " %";
  rows("trialrows", [
    ["gate", c.gate === null ? "passed: edged promote" : c.gate],
    ["frames", c.frames + " compared, " + c.skipped_busy + " skipped (busy), " + c.failed_frames + " failed"],
    ["agreement", pct(c.agreement)],
    ["verdicts", Object.entries(c.verdicts).map(([k, n]) => k + " " + n).join(", ") || "-"],
    ["score shift", c.score_shift === null ? "-" : c.score_shift.toFixed(3)],
    ["latency", c.latency ? c.latency.p50_ms.toFixed(1) + " / " + c.latency.p99_ms.toFixed(1) + " ms" : "-"],
    ["live frames", c.live_frames + " published, " + c.live_delayed + " delayed" + (c.live_delay ? " by " +
      c.live_delay.p50_ms.toFixed(1) + " / " + c.live_delay.p99_ms.toFixed(1) + " ms" : "")],
    ["added age", c.live_delay_ms === null ? "-" : c.live_delay_ms.toFixed(3) + " ms per frame (at most)"],
    ["saved", String(c.disagreements_saved)],
    ...(c.error ? [["error", c.error]] : [])]);
  rows("trialclasses", [["class", "matched", "live only", "candidate only"], ...Object.entries(c.classes).map(
    ([k, v]) => [k, String(v.matched), String(v.live_only), String(v.candidate_only)])]);
}
async function cameras() {
  const r = await fetch("cameras.json" + q, {cache: "no-store"});
  if (!r.ok) return;
  const list = (await r.json()).cameras;
  $("cameras").hidden = list.length < 2;
  if (list.length < 2) return;
  const shown = params.get("camera") || list[0].camera_id;
  $("cameras").replaceChildren(...list.map((c) => {
    const link = new URLSearchParams(params);
    link.set("camera", c.camera_id);
    const a = document.createElement("a");
    a.href = "?" + link;
    a.dataset.camera = c.camera_id;
    const kind = c.source_state !== "ok" ? "warn" : c.verdict === "ng" ? "bad" : c.verdict === "uncertain" ? "warn" : "ok";
    a.className = "pill " + kind + (c.camera_id === shown ? " shown" : "");
    const tally = c.verdict ? " " + c.verdict.toUpperCase() + " (ng " + c.ng + " of " + (c.ok + c.ng) + ")" : "";
    a.textContent = c.camera_id + " " + c.source_state + tally;
    return a;
  }));
}
async function tick() {
  try {
    await cameras();
    const r = await fetch("status.json" + q, {cache: "no-store"});
    if (!r.ok) throw new Error(r.status);
    const s = await r.json();
    $("camera").textContent = s.camera_id;
    document.title = "edged " + s.camera_id;
    pill("state", "camera " + s.source_state, s.source_state === "ok" ? "ok" : "bad");
    $("fps").textContent = s.fps.toFixed(1);
    $("age").textContent = s.latency.age ? s.latency.age.p50_ms.toFixed(1) + " ms" : "-";
    $("cap").textContent = s.rate_cap_fps === null ? "none" : s.rate_cap_fps.toFixed(1) + " fps";
    const t = s.thermal;
    const hottest = t && t.hottest_c !== null ? " " + t.hottest_c.toFixed(1) + " \\u00b0C" : "";
    $("thermal").textContent = t ? t.state + hottest : "off";
    $("frames").textContent = s.frames_processed;
    $("model").textContent = s.model.name + " (" + s.model.provider + ")";
    $("uptime").textContent = Math.round(s.uptime_s) + " s";
    const o = s.opcua;
    $("opcua-row").hidden = !o;
    const served = o ? o.clients + " client(s), " + o.requests + " request(s)" : "";
    if (o) $("opcua").textContent = (o.serving ? "" : "not serving: ") + served;
    const m = s.modbus;
    $("modbus-row").hidden = !m;
    if (m) $("modbus").textContent = m.clients + " client(s), " + m.requests + " requests";
    const stages = Object.entries(s.latency).map(([k, v]) => [k, v.p50_ms.toFixed(2), v.p99_ms.toFixed(2)]);
    rows("latency", [["stage", "p50", "p99"], ...stages]);
    const drops = Object.entries(s.drops).filter(([, n]) => n > 0).map(([k, n]) => [k, String(n)]);
    rows("drops", drops.length ? drops : [["none"]]);
    const rj = s.reject, ms = (v) => v === null ? "-" : v.toFixed(2);
    $("reject").hidden = !rj;
    if (rj) rows("rejects", [
      ["pulses", String(rj.pulses)], ["late, rejected", rj.late + ", " + rj.late_fired],
      ["late verdicts", String(rj.late_verdicts)], ["merged", String(rj.merged)],
      ["dropped, un-ejected", String(rj.dropped)],
      ["lateness ms, p50/p99/max", [rj.lateness_p50_ms, rj.lateness_p99_ms, rj.lateness_max_ms].map(ms).join(" / ")],
      ["margin ms, p1/p50", ms(rj.margin_p1_ms) + " / " + ms(rj.margin_p50_ms)],
      ...(rj.alarm ? [["alarm", "ON"]] : []), ...(rj.last_error ? [["error", rj.last_error]] : [])]);
    candidate(s.candidate);
    await verdicts();
    const h = await fetch("healthz" + q, {cache: "no-store"});
    pill("health", h.ok ? "healthy" : "unhealthy: " + (await h.text()).trim(), h.ok ? "ok" : "bad");
  } catch (e) {
    pill("state", "no status (" + e.message + ")", "warn");
  }
}
tick();
setInterval(tick, 1000);
</script></body></html>
"""
