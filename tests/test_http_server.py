"""The HTTP server's request side: clients that leave before their answer, HEAD, and request lines
built to be costly to log, against the real daemon and a server of its own, over real sockets."""

from __future__ import annotations

import http.client
import logging
import select
import socket
import struct
from collections.abc import Iterator

import pytest
from daemon import RunningDaemon, free_port, write_config
from onnx_models import colour_probe
from waiting import wait_for

from edged import http_server
from edged.http import HttpServer
from edged.settings.http import MAX_CONNECTIONS, HttpConfig

pytestmark = pytest.mark.integration

LEFT = "left before its answer was sent"


@pytest.fixture(scope="module")
def cameraless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, int]]:
    """A daemon whose camera never delivers (an empty image folder), with the live view and debug logging on:
    a snapshot waits its whole 5 s for a frame, then answers 503."""
    workdir = tmp_path_factory.mktemp("cameraless")
    colour_probe(workdir / "probe.onnx")
    (workdir / "frames").mkdir()
    port, endpoint = free_port(), f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        workdir / "edged.toml",
        {
            "source": {"type": "images", "path": "frames"},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [endpoint]},
            "thermal": {"enabled": False},
            "http": {"listen": f"127.0.0.1:{port}"},
            "service": {"log_level": "debug"},
        },
    )
    d = RunningDaemon(config, endpoint)
    try:
        assert wait_for(lambda: "live view, status page and metrics on" in d.log(), 30), d.log()
        yield d, port
    finally:
        d.close()


def _request(port: int, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_a_client_that_resets_before_its_answer_leaves_no_traceback(cameraless: tuple[RunningDaemon, int]) -> None:
    d, port = cameraless
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(b"GET /snapshot.jpg HTTP/1.0\r\n\r\n")
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    client.close()
    # The snapshot's 503 comes after 5 s, to a connection reset long before: logged one way or the other.
    assert wait_for(lambda: LEFT in d.log() or "Exception occurred" in d.log(), 30), d.log()
    assert "Traceback" not in d.log() and "Exception occurred" not in d.log(), d.log()
    assert _request(port, "GET", "/status.json")[0] == 200  # served as before


@pytest.mark.parametrize("path", ["/healthz", "/metrics", "/status.json", "/cameras.json", "/", "/nowhere"])
def test_head_answers_what_get_does_without_the_body(cameraless: tuple[RunningDaemon, int], path: str) -> None:
    _, port = cameraless
    assert wait_for(lambda: _request(port, "GET", "/status.json")[0] == 200, 30)
    got_status, got_headers, got_body = _request(port, "GET", path)
    status, headers, body = _request(port, "HEAD", path)
    assert (status, headers["content-type"], body) == (got_status, got_headers["content-type"], b"")
    if path not in ("/metrics", "/status.json", "/cameras.json"):  # these change between two requests
        assert int(headers["content-length"]) == len(got_body)


def test_head_of_the_stream_sends_its_headers_and_ends(cameraless: tuple[RunningDaemon, int]) -> None:
    _, port = cameraless
    status, headers, body = _request(port, "HEAD", "/stream.mjpg")
    assert status == 200 and headers["content-type"].startswith("multipart/x-mixed-replace; boundary=")
    assert body == b""


def test_a_request_line_is_masked_only_when_debug_lines_are_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    masked: list[str] = []
    real = http_server._mask_token

    def mask(text: str) -> str:
        masked.append(text)
        return real(text)

    monkeypatch.setattr(http_server, "_mask_token", mask)
    port = free_port()
    server = HttpServer(HttpConfig(listen=f"127.0.0.1:{port}"), health=lambda: None, cameras={"a": {}})
    server.start()
    try:
        assert wait_for(lambda: _answers(port), 30)
        caplog.set_level(logging.INFO, "edged.http_server")
        assert _request(port, "GET", "/nowhere" + "?" * 16000)[0] == 404
        assert _request(port, "GET", "/healthz?token=s3cret")[0] == 200
        assert masked == []  # nothing logged, nothing made: a line a client chose costs it nothing
        caplog.set_level(logging.DEBUG, "edged.http_server")
        assert _request(port, "GET", "/healthz?token=s3cret")[0] == 200
        assert len(masked) == 1 and "token=***" in caplog.text and "s3cret" not in caplog.text
    finally:
        server.close()


def _answers(port: int) -> bool:
    try:
        return _request(port, "GET", "/healthz")[0] == 200
    except OSError:
        return False


@pytest.mark.parametrize("line", ["?" * 1_000_000, "?a" * 500_000, "?" + "a" * 999_999])
def test_masking_a_line_takes_one_pass_whatever_it_holds(line: str) -> None:
    """Each place is tried once: trying each on to the end of the line took hours for a megabyte of ``?``.
    A name ends at a ``?``, so a token after two of them is masked too."""
    assert http_server._mask_token("/x??token=s3cret") == "/x??token=***"
    assert http_server._mask_token(f'"GET /{line} HTTP/1.0" 404 -') == f'"GET /{line} HTTP/1.0" 404 -'
    assert http_server._mask_token(f"/x??token=s3cret&{line}") == f"/x??token=***&{line}"


def test_snapshots_waiting_for_a_frame_are_viewers_and_cannot_lock_out_healthz(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pollers of a camera that delivers nothing, from two addresses, as many as the server takes."""
    monkeypatch.setattr(http_server, "SNAPSHOT_WAIT_S", 60.0)  # each waits a minute: longer than the test
    port, viewers = free_port(), MAX_CONNECTIONS - 4
    server = HttpServer(HttpConfig(listen=f"127.0.0.1:{port}", max_viewers=viewers), health=lambda: None, cameras={"a": {}})
    server.start()
    pollers: list[socket.socket] = []
    try:
        assert wait_for(lambda: _answers(port), 30)
        for i in range(MAX_CONNECTIONS):
            poller = socket.socket()
            poller.bind((f"127.0.0.{2 + i % 2}", 0))
            poller.connect(("127.0.0.1", port))
            poller.sendall(b"GET /snapshot.jpg HTTP/1.0\r\n\r\n")
            pollers.append(poller)
        assert wait_for(lambda: server.views["a"].viewers == viewers, 20)
        assert wait_for(lambda: server.refusals()["max_viewers"] == MAX_CONNECTIONS - viewers, 20)
        assert wait_for(lambda: _answers(port), 20)  # on one of the connections kept for everything else

        def answered() -> list[socket.socket]:
            return select.select(pollers, [], [], 0)[0]

        assert wait_for(lambda: len(answered()) == MAX_CONNECTIONS - viewers, 20)
        refused = [p.recv(4096) for p in answered()]
        assert all(b" 503 " in r and b"http.max_viewers" in r and b"Retry-After: 5" in r for r in refused), refused
    finally:
        for poller in pollers:
            poller.close()
        server.close()
