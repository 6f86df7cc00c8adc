"""The HTTP server with several cameras: ``?camera=ID`` on the page, stream, snapshot, status and
verdicts of the real daemon (two cameras of different frame sizes, each with its own zones and
verdicts), read by real clients (http.client, headless Chromium); a camera a reload removes ends
its viewers' streams; a camera nobody watches is never offered a frame."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest
from daemon import RunningDaemon, free_port, write_config, write_video
from onnx_models import colour_probe
from test_http import Stream, decode, get, serving
from waiting import wait_for

from edged.http import HttpServer
from edged.messages import DetectionsMessage, ModelInfo, Timings
from edged.settings.http import HttpConfig
from edged.sources.base import Frame
from edged.view import BANNER, ZONE_PALETTE

pytestmark = pytest.mark.integration

TOKEN = "0123456789abcdef0123456789abcdef"
RED, BLUE = (0, 0, 255), (255, 0, 0)
# Camera "a", 320x240 red, has its own zone in the bottom-right corner: the probe's box, mid-frame, lies
# outside it and is dropped (OK). Camera "b", 448x256 blue, is inspected on the whole frame (NG).
CORNER = {"corner": [[0.7, 0.7], [1.0, 0.7], [1.0, 1.0], [0.7, 1.0]]}
ON_CORNER_A = (167, 300)  # (y, x) on the corner zone's top edge in a's 320x240 frame
SIZES = {"a": (240, 320, 3), "b": (256, 448, 3)}


def _workdir(workdir: Path) -> Path:
    colour_probe(workdir / "probe.onnx")
    write_video(workdir / "a.avi", [RED] * 20, size=(320, 240))
    write_video(workdir / "b.avi", [BLUE] * 20, size=(448, 256))
    (workdir / "imgs").mkdir()
    cv2.imwrite(str(workdir / "imgs" / "000.png"), np.full((150, 200, 3), RED, np.uint8))
    return workdir


def _source(camera: str, **keys: object) -> dict[str, object]:
    return {"type": "file", "camera_id": camera, "path": f"{camera}.avi", "loop": True, "realtime": True, **keys}


def _doc(sources: list[dict[str, object]], endpoint: str, http: dict[str, object]) -> dict:
    return {
        "source": sources,
        "model": {"path": "probe.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.3},
        "thermal": {"enabled": False},
        "http": {"jpeg_quality": 95, **http},
        "inspect": {"outside_zones": "drop"},
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, int]]:
    """Cameras a and b, served with a token (on loopback too, so that every request checks it)."""
    workdir = _workdir(tmp_path_factory.mktemp("two"))
    token_file = workdir / "http.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port, endpoint = free_port(), f"tcp://127.0.0.1:{free_port()}"
    http = {"listen": f"127.0.0.1:{port}", "token_file": "http.token"}
    config = write_config(workdir / "edged.toml", _doc([_source("a", zones=CORNER), _source("b")], endpoint, http))
    d = RunningDaemon(config, endpoint)
    try:
        assert serving(port), d.log()
        d.wait_status(lambda s: s.camera_id == "b" and s.frames_processed > 0, timeout=60)
        yield d, port
    finally:
        d.close()


def _near(pixel: np.ndarray, colour: tuple[int, int, int], within: int = 90) -> bool:
    return int(np.abs(pixel.astype(np.int32) - np.array(colour, np.int32)).sum()) < within


def _json(port: int, path: str) -> dict:
    status, headers, body = get(port, path)
    assert status == 200 and headers["content-type"] == "application/json", (path, status, body)
    result: dict = json.loads(body)
    return result


def test_each_camera_has_its_own_snapshot_stream_zones_verdicts_and_status(two: tuple[RunningDaemon, int]) -> None:
    _, port = two
    shown = {}
    for camera in ("a", "b"):
        status, headers, body = get(port, f"/snapshot.jpg?camera={camera}&token={TOKEN}")
        assert status == 200 and headers["content-type"] == "image/jpeg", (camera, body[:200])
        shown[camera] = decode(body)
        assert shown[camera].shape == SIZES[camera]
    a, b = shown["a"], shown["b"]
    assert _near(a[ON_CORNER_A], ZONE_PALETTE[0]), a[ON_CORNER_A]  # a's own zone, drawn on a's frames only
    assert _near(b[round(0.7 * 255), 400], BLUE), b[round(0.7 * 255), 400]
    assert _near(a[120, 40], RED) and _near(b[128, 40], BLUE)  # each camera's own frame
    assert _near(a[3, 315], BANNER["ok"]) and _near(b[3, 443], BANNER["ng"]), (a[3, 315], b[3, 443])
    default = get(port, f"/snapshot.jpg?token={TOKEN}")  # no ?camera=: the first, as with one camera
    assert default[0] == 200 and decode(default[2]).shape == SIZES["a"]

    stream = Stream(port, f"?token={TOKEN}&camera=b")  # the token and the camera in either order
    try:
        assert all(decode(stream.next_jpeg()).shape == SIZES["b"] for _ in range(3))
    finally:
        stream.close()

    def verdicts_counted() -> bool:
        both = [_json(port, f"/verdicts.json?camera={c}&token={TOKEN}") for c in ("a", "b")]
        return all(v["ok"] + v["ng"] > 0 for v in both)

    assert wait_for(verdicts_counted, 20)
    verdicts = {c: _json(port, f"/verdicts.json?camera={c}&token={TOKEN}") for c in ("a", "b")}
    assert verdicts["a"]["ok"] > 0 and verdicts["a"]["ng"] == 0, verdicts["a"]
    assert verdicts["b"]["ng"] > 0 and verdicts["b"]["ok"] == 0, verdicts["b"]
    assert {e["verdict"] for e in verdicts["b"]["latest"]} == {"ng"}
    assert _json(port, f"/verdicts.json?token={TOKEN}")["ng"] == 0  # the first camera's
    assert _json(port, f"/status.json?camera=b&token={TOKEN}")["camera_id"] == "b"
    assert _json(port, f"/status.json?token={TOKEN}")["camera_id"] == "a"

    overview = _json(port, f"/cameras.json?token={TOKEN}")["cameras"]
    assert [c["camera_id"] for c in overview] == ["a", "b"]
    assert [(c["source_state"], c["verdict"]) for c in overview] == [("ok", "ok"), ("ok", "ng")], overview
    assert overview[1]["ng"] > 0 and overview[1]["ok"] == 0 and overview[0]["fps"] > 0


def test_an_unknown_camera_is_a_404_naming_the_cameras_and_the_token_is_still_required(
    two: tuple[RunningDaemon, int],
) -> None:
    _, port = two
    for path in ("/", "/stream.mjpg", "/snapshot.jpg", "/status.json", "/verdicts.json"):
        status, headers, body = get(port, f"{path}?camera=front&token={TOKEN}")
        assert status == 404 and "no camera 'front': cameras are a, b" in body.decode(), (path, status, body)
        kind = "application/json" if path.endswith(".json") else "text/plain; charset=utf-8"
        assert headers["content-type"] == kind, path
        if path.endswith(".json"):
            assert "cameras are a, b" in json.loads(body)["error"]
        for query in ("?camera=b", "?camera=b&token=wrong", "?camera=front"):  # 401 before the camera is looked at
            status, _, body = get(port, path + query)
            assert status == 401 and b"\xff\xd8" not in body, (path, query)
    assert get(port, "/cameras.json?camera=b")[0] == 401


def test_headless_chromium_renders_the_camera_picker_with_the_token_in_its_links(two: tuple[RunningDaemon, int]) -> None:
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (scripts/setup test installs it)"
    _, port = two
    url = f"http://127.0.0.1:{port}/?token={TOKEN}&camera=b"
    args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--timeout=5000", "--dump-dom", url]
    dom = subprocess.run(args, capture_output=True, timeout=60, text=True).stdout
    nav = re.search(r'<nav id="cameras">(.*?)</nav>', dom)  # shown: no hidden attribute
    assert nav, dom[-3000:]
    links = re.findall(r'<a href="\?([^"]*)" data-camera="(\w+)" class="([^"]*)">([^<]*)</a>', nav.group(1))
    assert [camera for _, camera, _, _ in links] == ["a", "b"], nav.group(1)
    for query, camera, _, text in links:
        assert query.replace("&amp;", "&") == f"token={TOKEN}&camera={camera}"  # the page's token goes on
        assert text.startswith(f"{camera} ok ")
    (_, _, a_class, a_text), (_, _, b_class, b_text) = links
    assert "OK (ng 0 of" in a_text and "NG (ng " in b_text
    assert "shown" in b_class and "shown" not in a_class and "bad" in b_class
    assert 'id="camera">b<' in dom and 'id="state" class="pill ok">camera ok<' in dom
    assert re.search(r'<td class="bad">NG</td>', dom) and not re.search(r'<td class="ok">OK</td>', dom), dom[-3000:]


def _read_to_the_end(stream: Stream, timeout_s: float) -> bytes:
    """What the server sends until it closes the stream; fails if it is still open after ``timeout_s``."""
    got = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        chunk = stream.resp.read1(65536)
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the stream still runs after {timeout_s} s")


def test_a_camera_removed_by_a_reload_ends_its_streams_and_one_added_is_served(tmp_path: Path) -> None:
    workdir = _workdir(tmp_path)
    port, endpoint = free_port(), f"tcp://127.0.0.1:{free_port()}"
    http = {"listen": f"127.0.0.1:{port}"}
    config = write_config(workdir / "edged.toml", _doc([_source("a"), _source("b")], endpoint, http))
    d = RunningDaemon(config, endpoint)
    streams: list[Stream] = []
    try:
        assert serving(port), d.log()
        streams = [Stream(port, "?camera=a"), Stream(port, "?camera=b")]
        kept, removed = streams
        assert decode(kept.next_jpeg()).shape == SIZES["a"] and decode(removed.next_jpeg()).shape == SIZES["b"]
        stills = {"type": "images", "camera_id": "c", "path": "imgs", "fps": 5.0}
        write_config(workdir / "edged.toml", _doc([_source("a"), stills], endpoint, http))
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "reloaded: model" in d.log(), 60), d.log()
        rest = _read_to_the_end(removed, 30)
        assert rest.endswith(b"--frame--\r\n"), rest[-200:]  # the multipart stream's closing delimiter
        for _ in range(3):
            assert decode(kept.next_jpeg()).shape == SIZES["a"]  # the same connection goes on
        snapshot = get(port, "/snapshot.jpg?camera=c")
        assert snapshot[0] == 200 and decode(snapshot[2]).shape == (150, 200, 3)
        status, _, body = get(port, "/snapshot.jpg?camera=b")
        assert status == 404 and b"cameras are a, c" in body
        assert d.proc.poll() is None
    finally:
        for stream in streams:
            stream.close()
        d.close()


def _offer(server: HttpServer, camera: str, size: tuple[int, int]) -> None:
    w, h = size
    message = DetectionsMessage(
        camera_id=camera,
        seq=0,
        frame_id=1,
        capture_time_ns=time.time_ns(),
        frame_size=size,
        input_size=(64, 64),
        model=ModelInfo(name="probe", sha256="ab" * 32, provider="CPUExecutionProvider"),
        detections=[],
        timings=Timings(preprocess_ms=1.0, inference_ms=2.0, decode_ms=0.5, age_ms=4.0),
        thermal_state="ok",
    )
    server.offer(camera, Frame(np.full((h, w, 3), 128, np.uint8), 1, time.monotonic_ns(), time.time_ns(), "bgr"), message)


def test_only_a_watched_camera_is_offered_frames_and_following_fewer_cameras_ends_the_others_streams() -> None:
    port = free_port()
    server = HttpServer(
        HttpConfig(listen=f"127.0.0.1:{port}", view_fps=30.0), health=lambda: None, cameras={"a": {}, "b": {}}
    )
    server.start()
    stream = None
    try:
        assert serving(port)
        assert not any(server.wants_frame(c) for c in ("a", "b", "gone"))  # nobody watches
        stream = Stream(port, "?camera=b")
        assert wait_for(lambda: server.wants_frame("b"), 10)
        assert not server.wants_frame("a") and not server.wants_frame("gone")
        _offer(server, "b", (96, 64))
        assert decode(stream.next_jpeg()).shape == (64, 96, 3)
        server.follow_cameras({"a": {}})  # a reload removed b
        assert _read_to_the_end(stream, 10).endswith(b"--frame--\r\n")
        assert list(server.views) == ["a"] and not server.wants_frame("b")
        assert wait_for(lambda: get(port, "/snapshot.jpg?camera=b")[0] == 404, 10)
    finally:
        if stream is not None:
            stream.close()
        server.close()
