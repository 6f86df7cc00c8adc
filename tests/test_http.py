"""The HTTP server for people: the real daemon serving its page, stream, snapshot, status, metrics and
health on a free loopback port, read by real clients (http.client, promtool, headless Chromium)."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest
import zmq
from daemon import RunningDaemon, free_port, rss_kb, run_cli, write_config, write_video
from onnx_models import colour_probe, fixed_scene
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from waiting import wait_for

from edged.http import HttpServer
from edged.identity import Identity
from edged.journal import Entry, JournalStore
from edged.messages import DetectionsMessage, StatusMessage, VerdictMessage, parse_message
from edged.settings.http import MAX_CONNECTIONS, HttpConfig
from edged.stats import VERDICTS_KEPT
from edged.view import BANNER, PALETTE, ZONE_PALETTE

pytestmark = pytest.mark.integration

COLOUR = (90, 20, 20)  # BGR: the probe scores it "blue" (class 1, 0.35) only; dark beside every palette colour
ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "live-view.png"


def _config(
    workdir: Path,
    http: dict[str, object] | None = None,
    source: dict[str, object] | None = None,
    **sections: dict[str, object],
) -> tuple[Path, str, int]:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc: dict[str, dict[str, object]] = {
        "source": source or {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
        "model": {"path": "probe.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
        "thermal": {"enabled": False},
        "http": {"listen": f"127.0.0.1:{port}", **(http or {})},
    }
    for name, keys in sections.items():
        doc.setdefault(name, {}).update(keys)
    return write_config(workdir / "edged.toml", doc), endpoint, port


def _probe_workdir(workdir: Path, frames: int = 40) -> Path:
    colour_probe(workdir / "probe.onnx")
    write_video(workdir / "clip.avi", [COLOUR] * frames, size=(320, 240))
    return workdir


def get(
    port: int, path: str, headers: dict[str, str] | None = None, timeout: float = 10, source: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    """GET ``path``; from the loopback address ``source`` when given: another client, as far as the server can tell."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0) if source else None)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def serving(port: int, timeout: float = 30) -> bool:
    """True once the server answers at all (with a token configured, 401)."""

    def up() -> bool:
        try:
            get(port, "/healthz", timeout=2)
        except OSError:
            return False
        return True

    return wait_for(up, timeout)


class Stream:
    """A multipart/x-mixed-replace reader: each part's headers checked, its JPEG returned."""

    def __init__(self, port: int, query: str = "") -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        self.conn.request("GET", "/stream.mjpg" + query)
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        content_type = self.resp.getheader("Content-Type", "")
        assert content_type.startswith("multipart/x-mixed-replace; boundary=")
        self.boundary = b"--" + content_type.split("boundary=")[1].encode()

    def next_jpeg(self) -> bytes:
        line = self.resp.readline()
        while line.strip() == b"":
            line = self.resp.readline()
        assert line.strip() == self.boundary, line
        headers = {}
        while (line := self.resp.readline().strip()) != b"":
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        assert headers["content-type"] == "image/jpeg"
        jpeg = self.resp.read(int(headers["content-length"]))
        assert jpeg[:2] == b"\xff\xd8" and jpeg[-2:] == b"\xff\xd9"  # SOI ... EOI
        return jpeg

    def close(self) -> None:
        self.conn.close()


def decode(jpeg: bytes) -> np.ndarray:
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image is not None
    return image


def samples(text: str, name: str) -> list[Sample]:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name]


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    for sample in samples(text, name):
        if all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
            return float(sample.value)
    raise AssertionError(f"{name}{labels or ''} not in /metrics:\n{text}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, int]]:
    workdir = _probe_workdir(tmp_path_factory.mktemp("served"))
    path, endpoint, port = _config(workdir)
    d = RunningDaemon(path, endpoint)
    try:
        assert serving(port), d.log()
        yield d, port
    finally:
        d.close()


def test_metrics_pass_promtool_and_move_as_frames_flow(served: tuple[RunningDaemon, int]) -> None:
    d, port = served
    # A frame processed and the camera up, then one more round: /metrics follows the stream by up to one.
    d.wait_status(lambda s: s.frames_processed > 0 and s.source_state == "ok")
    d.collect("status", 1)
    status, headers, body = get(port, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=")
    text = body.decode()
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    for name in (
        "edged_frames_total",
        "edged_frames_dropped_total",
        "edged_stage_duration_seconds_bucket",
        "edged_frame_age_seconds_bucket",
        "edged_source_up",
        "edged_rate_cap_fps",
        "edged_build_info",
    ):
        assert re.search(rf"^{name}[{{ ]", text, re.M), name
    assert "_created" not in text
    assert metric_value(text, "edged_source_up") == 1.0
    assert {"stale_slow", "rate_capped", "not_requested", "read_error"} <= {
        s.labels["reason"] for s in samples(text, "edged_frames_dropped_total")
    }
    [info] = [s.labels for s in samples(text, "edged_build_info")]
    model = d.collect("detections", 1)[0].model
    assert (info["model_sha256"], info["provider"]) == (model.sha256, model.provider)
    frames = metric_value(text, "edged_frames_total")
    inference = metric_value(text, "edged_stage_duration_seconds_count", {"stage": "inference"})
    assert frames > 0 and inference == frames
    assert metric_value(text, "edged_stage_duration_seconds_bucket", {"stage": "inference", "le": "+Inf"}) == frames

    def moved() -> bool:
        later = get(port, "/metrics")[2].decode()
        return metric_value(later, "edged_frames_total") > frames + 5 and (
            metric_value(later, "edged_stage_duration_seconds_sum", {"stage": "decode"})
            > metric_value(text, "edged_stage_duration_seconds_sum", {"stage": "decode"})
        )

    assert wait_for(moved, 20), d.log()


def test_status_json_health_and_unknown_paths(served: tuple[RunningDaemon, int]) -> None:
    d, port = served
    d.wait_status(lambda s: s.frames_processed > 0 and s.source_state == "ok")
    d.collect("status", 1)  # /status.json follows the stream by up to one round
    status, headers, body = get(port, "/status.json")
    assert status == 200 and headers["content-type"] == "application/json"
    message = StatusMessage.model_validate_json(body)
    assert message.source_state == "ok" and message.frames_processed > 0
    assert get(port, "/healthz")[:3:2] == (200, b"ok\n")
    status, _, body = get(port, "/nothing-here")
    assert status == 404 and b"/stream.mjpg" in body
    status, _, body = get(port, "/verdicts.json")
    assert status == 404 and b"[inspect] is not configured" in body
    page = get(port, "/")
    assert page[0] == 200 and page[1]["content-type"].startswith("text/html")
    assert not re.search(rb"(src|href)=\"?(https?:)?//", page[2])  # nothing from the network: boards are offline


def test_the_stream_sends_successive_jpegs_with_boxes_where_the_detections_are(served: tuple[RunningDaemon, int]) -> None:
    d, port = served
    message = next(m for m in d.collect("detections", 5) if isinstance(m, DetectionsMessage) and m.detections)
    assert len(message.detections) == 1
    det = message.detections[0]
    stream = Stream(port)
    try:
        images = [decode(stream.next_jpeg()) for _ in range(3)]
    finally:
        stream.close()
    colour, frame = np.array(PALETTE[det.class_id], np.int32), np.array(COLOUR, np.int32)
    x1, y1, x2, y2 = (round(v) for v in det.box)
    for image in images:
        assert image.shape == (240, 320, 3)  # narrower than view_width: shown as it is
        edges = [image[(y1 + y2) // 2, x1], image[(y1 + y2) // 2, x2], image[y2, (x1 + x2) // 2]]
        for pixel in edges:  # the box's left, right and bottom edges, in the class's colour (JPEG blurs it)
            distance = np.abs(pixel.astype(np.int32) - colour).sum()
            assert distance < np.abs(pixel.astype(np.int32) - frame).sum() and distance < 150, (pixel, det.box)
        inside = image[(y1 + y2) // 2, (x1 + x2) // 2].astype(np.int32)
        outside = image[10, 300].astype(np.int32)
        for pixel in (inside, outside):  # the frame itself, untouched
            assert np.abs(pixel - np.array(COLOUR)).sum() < 40, pixel
    snapshot = get(port, "/snapshot.jpg")
    assert snapshot[0] == 200 and snapshot[1]["content-type"] == "image/jpeg"
    assert decode(snapshot[2]).shape == (240, 320, 3)


# Found in every 320x240 frame (input 64x64: frame x = input x * 5, y = (input y - 8) * 5): a
# scratch centred at (80, 60) and a crack at (240, 60), boxes 40 px wide.
SCENE = [(16.0, 20.0, 8.0, 8.0, 0, 0.9), (48.0, 20.0, 8.0, 8.0, 1, 0.8)]
GREY = (90, 90, 90)
LEFT = [[0, 0], [0.5, 0], [0.5, 1], [0, 1]]  # holds the scratch: NG
BOTTOM_RIGHT = [[0.5, 0.5], [1, 0.5], [1, 1], [0.5, 1]]  # holds nothing: OK
ON_LEFT, ON_BOTTOM_RIGHT = (60, 160), (120, 290)  # (y, x) on one zone's outline and off the other's


def _near(pixel: np.ndarray, colour: tuple[int, int, int], within: int = 90) -> bool:
    return int(np.abs(pixel.astype(np.int32) - np.array(colour, np.int32)).sum()) < within


def _shown_until(stream: Stream, banner: tuple[int, int, int], frames: int = 100) -> np.ndarray:
    """The first streamed image whose banner has the colour ``banner`` (a reload takes a few frames)."""
    for _ in range(frames):
        image = decode(stream.next_jpeg())
        if _near(image[3, 315], banner):
            return image
    raise AssertionError(f"no banner of colour {banner} in {frames} frames; the last had {image[3, 315]}")


def test_inspection_zones_verdict_banner_verdict_list_and_metrics_on_the_running_daemon(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "scene.onnx", SCENE)
    write_video(tmp_path / "clip.avi", [GREY] * 20, size=(320, 240))
    port, endpoint = free_port(), f"tcp://127.0.0.1:{free_port()}"
    doc: dict[str, dict[str, object]] = {
        "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
        "model": {"path": "scene.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
        "thermal": {"enabled": False},
        "http": {"listen": f"127.0.0.1:{port}", "jpeg_quality": 95},
        "inspect": {"zones": {"left": LEFT}},
        "evidence": {"dir": "evidence", "max_per_minute": 5},
    }
    path = write_config(tmp_path / "edged.toml", doc)
    d = RunningDaemon(path, endpoint)
    stream = None
    try:
        assert serving(port), d.log()
        stream = Stream(port)
        ng = _shown_until(stream, BANNER["ng"], frames=5)
        assert _near(ng[ON_LEFT], ZONE_PALETTE[0]) and _near(ng[ON_BOTTOM_RIGHT], GREY), (ng[ON_LEFT], ng[ON_BOTTOM_RIGHT])
        assert _near(ng[80, 80], ZONE_PALETTE[0])  # the scratch's bottom edge (y 40..80), in its zone's colour
        assert _near(ng[60, 220], GREY)  # the crack's left edge: outside every zone, dropped, no box
        d.wait_status(lambda s: s.evidence is not None and s.evidence.saved > 0 and s.evidence.rate_limited > 0)
        d.collect("status", 1)
        status, headers, body = get(port, "/verdicts.json")
        assert status == 200 and headers["content-type"] == "application/json"
        listed = json.loads(body)
        assert listed["ng"] > 0 and listed["ok"] == 0 and 0 < len(listed["latest"]) <= VERDICTS_KEPT
        newest = listed["latest"][0]
        assert newest["verdict"] == "ng" and newest["part_id"] is None
        assert [(r["label"], r["zone"]) for r in newest["reasons"]] == [("scratch", "left")]
        assert newest["frame_id"] > listed["latest"][-1]["frame_id"]  # newest first
        metrics = get(port, "/metrics")[2]
        check = subprocess.run(["promtool", "check", "metrics"], input=metrics, capture_output=True, timeout=60)
        assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
        text = metrics.decode()
        ng_count = metric_value(text, "edged_verdicts_total", {"verdict": "ng"})
        assert ng_count > 0 and metric_value(text, "edged_verdicts_total", {"verdict": "ok"}) == 0
        assert metric_value(text, "edged_ng_reasons_total", {"class": "scratch", "zone": "left"}) == ng_count
        assert metric_value(text, "edged_verdict_latency_seconds_count") == ng_count
        assert metric_value(text, "edged_evidence_saved_total") > 0
        assert metric_value(text, "edged_evidence_rate_limited_total") > 0
        assert metric_value(text, "edged_evidence_bytes") > 0
        for name in ("edged_evidence_dropped_total", "edged_evidence_errors_total"):
            assert metric_value(text, name) == 0

        doc["inspect"] = {"zones": {"corner": BOTTOM_RIGHT}}  # the scratch and the crack outside it: OK
        write_config(path, doc)
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "reloaded: model" in d.log(), 30), d.log()
        ok = _shown_until(stream, BANNER["ok"])  # the same connection goes on, with the new zones
        assert _near(ok[ON_BOTTOM_RIGHT], ZONE_PALETTE[0]) and _near(ok[ON_LEFT], GREY), (ok[ON_BOTTOM_RIGHT], ok[ON_LEFT])

        def counted_ok() -> bool:
            later = get(port, "/metrics")[2].decode()
            return metric_value(later, "edged_verdicts_total", {"verdict": "ok"}) > 0

        assert wait_for(counted_ok, 20), d.log()
        later = get(port, "/metrics")[2].decode()
        assert metric_value(later, "edged_verdicts_total", {"verdict": "ng"}) >= ng_count  # counted since start
        assert json.loads(get(port, "/verdicts.json")[2])["latest"][0]["verdict"] == "ok"
    finally:
        if stream is not None:
            stream.close()
        d.close()


def test_headless_chromium_renders_the_page_with_the_live_image_the_fps_and_the_verdicts(tmp_path: Path) -> None:
    """Also writes the README's screenshot when EDGED_WRITE_SCREENSHOT=1."""
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (scripts/setup test installs it)"
    path, endpoint, port = _config(
        tmp_path,
        source={"type": "synthetic", "camera_id": "line-3", "width": 1280, "height": 720, "fps": 10.0},
        model={"path": str(ROOT / "models" / "demo.onnx"), "labels": str(ROOT / "models" / "demo.labels")},
        inspect={"zones": {"belt": [[0.05, 0.15], [0.95, 0.15], [0.95, 0.95], [0.05, 0.95]]}, "outside_zones": "keep"},
    )
    d = RunningDaemon(path, endpoint)
    try:
        assert serving(port), d.log()
        d.wait_status(lambda s: s.frames_processed > 10 and s.fps > 0, timeout=60)
        url = f"http://127.0.0.1:{port}/"
        args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--timeout=5000"]
        png = tmp_path / "page.png"
        shot = subprocess.run([*args, "--window-size=1000,640", f"--screenshot={png}", url], capture_output=True, timeout=60)
        assert png.is_file(), shot.stderr.decode()[-2000:]
        dom = subprocess.run([*args, "--dump-dom", url], capture_output=True, timeout=60, text=True).stdout
    finally:
        d.close()
    assert re.search(r'id="fps">[0-9]+\.[0-9]<', dom), dom[-3000:]  # filled in from /status.json (it starts as "-")
    assert 'id="state" class="pill ok">camera ok<' in dom
    assert re.search(r'<td class="(ok|bad)">(OK|NG)</td>', dom), dom[-3000:]  # the latest verdicts, listed
    image = cv2.imread(str(png))
    live = image[60:400, 20:650]  # where the page places the live image (640 px wide, 16:9 here)
    assert live.std() > 10, "the live image region is blank"
    assert np.abs(live.astype(np.int32) - image[470, 990].astype(np.int32)).sum(axis=2).mean() > 60  # not page
    if os.environ.get("EDGED_WRITE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(exist_ok=True)
        small = cv2.resize(image, (800, 512), interpolation=cv2.INTER_AREA)  # small enough to commit
        cv2.imwrite(str(SCREENSHOT), small, [cv2.IMWRITE_PNG_COMPRESSION, 9])


def test_in_request_mode_a_viewer_sees_an_unannotated_preview_between_requests(tmp_path: Path) -> None:
    """Between requests nothing runs through the model, yet the stream shows the camera (no boxes)
    at view_fps; the frames nobody asked for count as not requested."""
    colour_probe(tmp_path / "probe.onnx")
    (tmp_path / "imgs").mkdir()
    cv2.imwrite(str(tmp_path / "imgs" / "part.png"), np.full((240, 320, 3), COLOUR, np.uint8))
    trigger = f"tcp://127.0.0.1:{free_port()}"
    path, endpoint, port = _config(
        tmp_path,
        http={"view_fps": 10.0},
        source={"type": "images", "path": "imgs", "fps": 20.0},
        trigger={"mode": "request", "endpoint": trigger, "timeout_s": 10.0},
    )
    d = RunningDaemon(path, endpoint)
    context = zmq.Context()
    stream = None
    try:
        assert serving(port), d.log()
        stream = Stream(port)
        before = [decode(stream.next_jpeg()) for _ in range(3)]
        request = context.socket(zmq.REQ)
        request.setsockopt(zmq.LINGER, 0)
        request.connect(trigger)
        request.send(b'{"part_id": "P-1"}')
        assert request.poll(20_000), d.log()
        assert isinstance(parse_message(request.recv()), VerdictMessage)
        after = [decode(stream.next_jpeg()) for _ in range(6)]  # the request's annotated frame, then previews
        status = d.wait_status(lambda s: s.frames_processed >= 1)
        chromium = shutil.which("chromium")
        assert chromium, "Debian's chromium is needed (scripts/setup test installs it)"
        png = tmp_path / "page.png"
        args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--timeout=5000"]
        shot = subprocess.run(
            [*args, "--window-size=1000,640", f"--screenshot={png}", f"http://127.0.0.1:{port}/"],
            capture_output=True,
            timeout=60,
        )
        assert png.is_file(), shot.stderr.decode()[-2000:]
    finally:
        if stream is not None:
            stream.close()
        context.destroy(linger=0)
        d.close()
    for image in [*before, after[-1]]:
        assert image.shape == (240, 320, 3)
        # Where the probe's box (120,50)-(200,110) would be drawn: the bare image, no outline, no label.
        assert np.abs(image[40:120, 110:210].astype(np.int32) - COLOUR).max() < 24
    assert status.drops["not_requested"] > 0 and status.drops["rate_capped"] == 0, status.drops
    assert "stale" not in status.drops
    page = cv2.imread(str(png))
    shown = page[150:300, 100:500].reshape(-1, 3).mean(axis=0)
    assert np.abs(shown - COLOUR).max() < 15, shown  # the page shows the camera (its background is #16181c)


def test_off_loopback_a_token_is_required_and_checked(tmp_path: Path) -> None:
    _probe_workdir(tmp_path)
    path, endpoint, port = _config(tmp_path, http={"listen": "0.0.0.0:8080"})
    refused = run_cli("run", "--config", str(path))
    assert refused.returncode == 78, refused.stderr
    assert "http.token_file" in refused.stderr and "not a loopback address" in refused.stderr
    token = "0123456789abcdef0123456789abcdef"
    token_file = tmp_path / "http.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o644)
    path, endpoint, port = _config(tmp_path, http={"token_file": "http.token"})
    too_open = run_cli("run", "--config", str(path))
    assert too_open.returncode == 78 and "chmod 600" in too_open.stderr, too_open.stderr
    token_file.chmod(0o600)
    d = RunningDaemon(path, endpoint)
    try:
        assert serving(port), d.log()
        d.collect("detections", 2)
        for wrong in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {token}"}):
            for where in ("/snapshot.jpg", "/stream.mjpg", "/metrics", "/status.json", "/"):
                status, headers, body = get(port, where, wrong)
                assert status == 401 and headers["content-type"].startswith("text/plain"), (where, wrong)
                assert b"\xff\xd8" not in body and b"edged_" not in body
        assert get(port, "/snapshot.jpg?token=wrong")[0] == 401
        good = get(port, "/snapshot.jpg", {"Authorization": f"Bearer {token}"})
        assert good[0] == 200 and decode(good[2]).shape == (240, 320, 3)
        stream = Stream(port, f"?token={token}")  # a browser's <img> can only send it this way
        try:
            decode(stream.next_jpeg())
        finally:
            stream.close()
        rotated = "fedcba9876543210fedcba9876543210"
        token_file.write_text(rotated + "\n")
        d.signal(signal.SIGHUP)  # a rotated token takes effect on reload
        assert wait_for(lambda: get(port, "/healthz", {"Authorization": f"Bearer {rotated}"})[0] == 200, 30), d.log()
        assert get(port, "/healthz", {"Authorization": f"Bearer {token}"})[0] == 401
    finally:
        d.close()


def test_page_and_stream_survive_a_sighup_reload_and_a_camera_reconnect(tmp_path: Path) -> None:
    _probe_workdir(tmp_path, frames=10)  # half a second per pass: the loop reopens the file often
    path, endpoint, port = _config(tmp_path)
    clip, away = tmp_path / "clip.avi", tmp_path / "unplugged.avi"
    d = RunningDaemon(path, endpoint)
    stream = None
    try:
        assert serving(port), d.log()
        stream = Stream(port)
        decode(stream.next_jpeg())
        path.write_text(path.read_text().replace('path = "probe.onnx"', 'path = "probe.onnx"\nconf = 0.5'))
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "reloaded: model" in d.log(), 30), d.log()
        for _ in range(3):
            decode(stream.next_jpeg())  # the same connection goes on
        assert get(port, "/")[0] == 200
        clip.rename(away)  # unplugged
        d.wait_status(lambda s: s.source_state == "lost")
        assert get(port, "/healthz")[0] == 200  # a reconnect in progress is healthy
        away.rename(clip)
        d.wait_status(lambda s: s.source_state == "ok" and s.capture is not None and s.capture.reconnects >= 1)
        for _ in range(3):
            decode(stream.next_jpeg())
        status = StatusMessage.model_validate_json(get(port, "/status.json")[2])
        assert status.capture is not None and status.capture.reconnects >= 1
        assert d.proc.poll() is None
    finally:
        if stream is not None:
            stream.close()
        d.close()


def test_a_reload_that_sets_http_listen_starts_the_server_and_one_that_empties_it_stops_it(tmp_path: Path) -> None:
    _probe_workdir(tmp_path)
    path, endpoint, port = _config(tmp_path, http={"listen": ""})
    on = path.read_text()
    d = RunningDaemon(path, endpoint)
    try:
        d.collect("detections", 1)
        path.write_text(on.replace('listen = ""', f'listen = "127.0.0.1:{port}"'))
        d.signal(signal.SIGHUP)
        assert serving(port), d.log()
        path.write_text(on)
        d.signal(signal.SIGHUP)

        def refused() -> bool:
            try:
                get(port, "/healthz", timeout=2)
            except ConnectionRefusedError:
                return True
            except OSError:  # reset or timed out while the server closes
                pass
            return False

        assert wait_for(refused, 30), d.log()
        d.collect("detections", 3)  # and detection goes on
        assert d.stop() == 0, d.log()
    finally:
        d.close()


def test_a_busy_port_is_logged_and_retried_while_detection_goes_on(tmp_path: Path) -> None:
    _probe_workdir(tmp_path)
    path, endpoint, port = _config(tmp_path)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    d = RunningDaemon(path, endpoint)
    try:
        d.collect("detections", 5)  # detection is not held up by the view
        assert wait_for(lambda: "cannot serve the live view" in d.log(), 20), d.log()
        assert "Address already in use" in d.log() and "retrying every" in d.log()
        blocker.close()  # the other instance went away
        assert serving(port), d.log()
        assert get(port, "/healthz")[0] == 200
        assert d.log().count("cannot serve the live view") == 1  # one line, not one per retry
    finally:
        blocker.close()
        d.close()


def _stalled_viewer(port: int) -> socket.socket:
    """A client that asks for the stream and then never reads a byte."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"GET /stream.mjpg HTTP/1.0\r\n\r\n")
    return sock


def _clients_held(pid: int, port: int) -> set[int]:
    """The client ports of the connections to ``port`` that process ``pid`` still holds open.

    A connection the server has closed may linger in the kernel (FIN-WAIT-1 behind data the client
    never read), but no longer belongs to the process: its inode is none of the process's fds.
    """
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    held = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], fields[9]
        if int(local.split(":")[1], 16) == port and inode in inodes and fields[3] != "0A":  # 0A: LISTEN
            held.add(int(remote.split(":")[1], 16))
    return held


@pytest.mark.slow
def test_viewers_that_never_read_do_not_slow_it_or_grow_it_for_a_minute(tmp_path: Path) -> None:
    _probe_workdir(tmp_path)
    path, endpoint, port = _config(tmp_path, http={"send_timeout_s": 2.0, "view_fps": 10.0})
    d = RunningDaemon(path, endpoint)
    stalled: list[socket.socket] = []
    try:
        assert serving(port), d.log()
        fps_before = d.wait_status(lambda s: s.frames_processed > 40, timeout=30).fps
        rss_before = rss_kb(d.proc.pid)
        probe = _stalled_viewer(port)  # the check below sees a connection the server holds
        assert wait_for(lambda: probe.getsockname()[1] in _clients_held(d.proc.pid, port), 10)
        probe.close()
        started = time.monotonic()
        statuses: list[StatusMessage] = []
        while time.monotonic() - started < 60:
            if len(stalled) < 6 and time.monotonic() - started > 10 * len(stalled):
                stalled.append(_stalled_viewer(port))  # a new one every ten seconds
            statuses += [m for m in d.messages(0.5) if isinstance(m, StatusMessage)]
        late = statuses[len(statuses) // 4 :]
        assert late, d.log()
        assert min(s.fps for s in late) > 0.7 * fps_before, ([s.fps for s in late], fps_before)
        assert rss_kb(d.proc.pid) - rss_before < 20_000  # KB: no queue grows for the stalled ones
        # Each was dropped once its connection's buffer was full for send_timeout_s (the last ones may
        # still be filling theirs).
        held = _clients_held(d.proc.pid, port)
        assert not held & {sock.getsockname()[1] for sock in stalled[:3]}, held
        assert d.proc.poll() is None
    finally:
        for sock in stalled:
            sock.close()
        d.close()


def test_a_viewer_beyond_max_viewers_gets_503() -> None:
    port = free_port()
    server = HttpServer(HttpConfig(listen=f"127.0.0.1:{port}", max_viewers=1), health=lambda: None, cameras={"cam0": {}})
    server.start()
    try:
        assert serving(port)
        stream = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        stream.request("GET", "/stream.mjpg")
        assert stream.getresponse().status == 200
        assert wait_for(lambda: server.views["cam0"].viewers == 1, 10)
        status, _, body = get(port, "/stream.mjpg")
        assert status == 503 and b"max_viewers" in body
        stream.close()
        assert wait_for(lambda: server.views["cam0"].viewers == 0, 10)  # noticed at its next frame or wake-up
    finally:
        server.close()


def test_a_close_wakes_the_serving_thread_which_lets_go_of_the_port() -> None:
    """The serving thread polls without a timeout (`serve_forever` polled every 0.5 s, and a stop or a
    reload that replaces the server waited for it): `close` wakes it, and once it returns the address is
    free for the next server."""
    port = free_port()
    for _ in range(2):  # the second binds the address the first let go of
        server = HttpServer(HttpConfig(listen=f"127.0.0.1:{port}"), lambda: None, {"cam0": {}})
        server.start()
        try:
            assert serving(port)
        finally:
            server.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed (or reset) ``sock``'s connection; never blocks."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def _handler_threads() -> int:
    return sum("process_request_thread" in thread.name for thread in threading.enumerate())


def test_a_request_header_trickled_past_the_deadline_is_cut_off() -> None:
    """The deadline is for the whole header: a byte every 0.1 s does not extend it, as a per-read timeout would."""
    port = free_port()
    server = HttpServer(HttpConfig(listen=f"127.0.0.1:{port}"), lambda: None, {"cam0": {}}, request_timeout_s=2.0)
    server.start()
    try:
        assert serving(port)
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.sendall(b"GET /healthz HTTP/1.0\r\nX-Slow: ")

            def cut_off() -> bool:
                try:
                    slow.sendall(b"a")
                except OSError:
                    return True
                time.sleep(0.1)  # the trickle's pace, not a wait for the server
                return _closed_by_server(slow)

            assert wait_for(cut_off, 60)
            assert time.monotonic() - started >= 2.0
        with socket.create_connection(("127.0.0.1", port)) as huge:
            huge.settimeout(10)
            with contextlib.suppress(ConnectionResetError):  # refused before it has sent it all
                huge.sendall(b"GET /healthz HTTP/1.0\r\nX-Huge: " + b"a" * 20_000 + b"\r\n\r\n")
            assert huge.recv(4096).startswith(b"HTTP/1.0 431")
        text = get(port, "/metrics")[2].decode()
        assert metric_value(text, "edged_http_refused_total", {"reason": "header_timeout"}) == 1
        assert metric_value(text, "edged_http_refused_total", {"reason": "header_too_large"}) == 1
        assert promtool_accepts(text.encode())
    finally:
        server.close()


def test_slow_headers_on_every_connection_cannot_lock_out_healthz_or_metrics() -> None:
    """32 connections that never finish their header (a slowloris) hold no slot a request needs: the
    oldest of them gives its connection to each newcomer, from the same address or another one, and
    the server's threads stay bounded."""
    port = free_port()
    cfg = HttpConfig(listen=f"127.0.0.1:{port}", max_connections_per_client=MAX_CONNECTIONS)
    server = HttpServer(cfg, lambda: None, {"cam0": {}}, request_timeout_s=600)
    server.start()
    slow: list[socket.socket] = []
    try:
        assert serving(port)
        assert wait_for(lambda: _handler_threads() == 0, 10)  # none left from the tests before
        for _ in range(MAX_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"GET /healthz HTTP/1.0\r\nX-Slow: a")
            slow.append(sock)
        assert wait_for(lambda: _handler_threads() == MAX_CONNECTIONS, 10)
        for source in ("127.0.0.1", "127.0.0.2", "127.0.0.1", "127.0.0.2"):
            assert get(port, "/healthz", source=source)[::2] == (200, b"ok\n")
            status, _, body = get(port, "/metrics", source=source)
            assert status == 200 and b"edged_http_refused_total" in body
        closed = [_closed_by_server(sock) for sock in slow]
        evicted = closed.count(True)  # one at least; more when a request came before the last one's thread ended
        assert evicted >= 1 and closed == [True] * evicted + [False] * (MAX_CONNECTIONS - evicted), closed  # oldest first
        assert _handler_threads() <= MAX_CONNECTIONS + 4
        text = get(port, "/metrics")[2].decode()
        assert metric_value(text, "edged_http_refused_total", {"reason": "header_evicted"}) >= evicted
    finally:
        for sock in slow:
            sock.close()
        server.close()


def test_a_client_beyond_its_connection_limit_and_connections_beyond_32_busy_ones_are_refused() -> None:
    """A client (an address) holds at most ``max_connections_per_client`` requests being served, and
    the server at most `MAX_CONNECTIONS`: more are closed at accept and counted, while other clients
    are still answered."""
    port = free_port()
    release = threading.Event()
    asked: list[int] = []

    def health() -> str | None:
        asked.append(1)
        release.wait(60)  # a request that takes long to answer, for as long as the test holds it
        return None

    cfg = HttpConfig(listen=f"127.0.0.1:{port}", max_viewers=MAX_CONNECTIONS - 4, max_connections_per_client=4)
    server = HttpServer(cfg, health, {"cam0": {}}, request_timeout_s=600)
    server.start()
    held: list[http.client.HTTPResponse] = []
    try:
        assert wait_for(lambda: _handler_threads() == 0, 10)  # none left from the tests before
        assert wait_for(lambda: serving_stream(port, held), 30)
        for _ in range(3):
            assert serving_stream(port, held)
        assert wait_for(lambda: server.views["cam0"].viewers == 4, 10)
        with socket.create_connection(("127.0.0.1", port)) as fifth:
            fifth.settimeout(10)
            assert fifth.recv(1) == b""  # closed at accept: no thread for it
        assert get(port, "/metrics", source="127.0.0.2")[0] == 200
        busy = []
        for i in range(MAX_CONNECTIONS - 4):  # 28 requests held, from 7 addresses, 4 each
            sock = socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.1.{i // 4 + 1}", 0))
            sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            busy.append(sock)
        assert wait_for(lambda: len(asked) == MAX_CONNECTIONS - 4, 10)
        with socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.3", 0)) as extra:
            extra.settimeout(10)
            assert extra.recv(1) == b""  # 32 requests are being served: closed at accept
        release.set()
        for sock in busy:
            sock.settimeout(10)
            assert sock.recv(64).startswith(b"HTTP/1.0 200")
            sock.close()
        assert wait_for(lambda: _handler_threads() == 4, 10)  # the streams
        text = get(port, "/metrics", source="127.0.0.2")[2].decode()
        assert metric_value(text, "edged_http_refused_total", {"reason": "per_client"}) == 1
        assert metric_value(text, "edged_http_refused_total", {"reason": "busy"}) == 1
    finally:
        release.set()
        for resp in held:
            resp.close()
        server.close()


def serving_stream(port: int, held: list[http.client.HTTPResponse]) -> bool:
    """Open a stream and keep its response (which holds the connection) in ``held``; False when the
    server did not admit it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/stream.mjpg")
        resp = conn.getresponse()
    except OSError:
        return False
    finally:
        conn.close()  # the response holds the connection from here on
    if resp.status != 200:
        resp.close()
        return False
    held.append(resp)
    return True


def test_the_token_never_reaches_the_log_and_the_scheme_is_case_insensitive(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = "0123456789abcdef0123456789abcdef"
    token_file = tmp_path / "http.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    server = HttpServer(HttpConfig(listen=f"127.0.0.1:{port}", token_file=token_file), lambda: None, {"cam0": {}})
    server.start()
    caplog.set_level(logging.DEBUG, logger="edged.http_server")
    try:
        assert serving(port)
        for scheme in ("bearer", "BEARER", "Bearer", "beaRer"):
            assert get(port, "/healthz", {"Authorization": f"{scheme} {token}"})[0] == 200, scheme
        assert get(port, "/healthz", {"Authorization": f"Basic {token}"})[0] == 401
        assert get(port, f"/healthz?camera=cam0&token={token}")[0] == 200
        assert get(port, f"/healthz?token={token}x&camera=cam0")[0] == 401
        assert get(port, f"/healthz?%74oken={token}")[0] == 200  # the name percent-encoded
        with socket.create_connection(("127.0.0.1", port)) as sock:  # a request line the server refuses
            sock.sendall(f"GET /healthz?token={token} HTTP/1.0 junk\r\n\r\n".encode())
            sock.settimeout(10)
            assert b"400" in sock.recv(4096)
        assert wait_for(lambda: caplog.text.count("oken=***") >= 4, 10), caplog.text
    finally:
        server.close()
    assert token not in caplog.text and "camera=cam0" in caplog.text


@pytest.mark.parametrize(("max_viewers", "arriving"), [(4, 12), (MAX_CONNECTIONS - 4, MAX_CONNECTIONS)])
def test_viewers_arriving_together_get_exactly_max_viewers_streams_and_healthz_still_answers(
    max_viewers: int, arriving: int
) -> None:
    port = free_port()
    cfg = HttpConfig(listen=f"127.0.0.1:{port}", max_viewers=max_viewers, max_connections_per_client=MAX_CONNECTIONS)
    server = HttpServer(cfg, health=lambda: None, cameras={"cam0": {}})
    server.start()
    together = threading.Barrier(arriving)
    answers: list[tuple[int, bytes]] = []
    streams: list[http.client.HTTPResponse] = []
    lock = threading.Lock()

    def viewer() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.connect()  # accepted before the others ask: they all ask at once
        together.wait(30)
        conn.request("GET", "/stream.mjpg")
        resp = conn.getresponse()
        body = b"" if resp.status == 200 else resp.read()
        with lock:
            answers.append((resp.status, body))
            streams.append(resp)  # it holds the connection

    try:
        assert serving(port)
        threads = [threading.Thread(target=viewer) for _ in range(arriving)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(answers) == arriving
        assert sorted(status for status, _ in answers).count(200) == max_viewers, answers
        refused = [body for status, body in answers if status != 200]
        assert all(b"max_viewers" in body for body in refused), refused
        assert wait_for(lambda: server.views["cam0"].viewers == max_viewers, 10)
        assert get(port, "/healthz")[:3:2] == (200, b"ok\n")  # the admitted streams left it a connection
        text = get(port, "/metrics")[2].decode()
        assert metric_value(text, "edged_http_refused_total", {"reason": "max_viewers"}) == arriving - max_viewers
        assert promtool_accepts(text.encode())
    finally:
        for resp in streams:
            resp.close()
        server.close()


def promtool_accepts(exposition: bytes) -> bool:
    check = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    return check.returncode == 0


def _status_with_host(port: int, host: str | None, path: str, connect: str = "127.0.0.1") -> tuple[int, bytes]:
    """GET ``path`` with ``Host: host`` (none at all for None), as a page's script would after DNS rebinding."""
    with socket.create_connection((connect, port)) as sock:
        sock.settimeout(10)
        header = "" if host is None else f"Host: {host}\r\n"
        sock.sendall(f"GET {path} HTTP/1.1\r\n{header}Connection: close\r\n\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_on_a_loopback_listen_only_loopback_names_and_allowed_hosts_are_answered() -> None:
    """A web page whose name was rebound to 127.0.0.1 sends its own name as Host: refused, so it reads nothing."""
    port = free_port()
    cfg = HttpConfig(listen=f"127.0.0.1:{port}", allowed_hosts=["Board.example"])
    server = HttpServer(cfg, lambda: None, {"cam0": {}})
    server.start()
    try:
        assert serving(port)
        for host in ("localhost", f"localhost:{port}", "LocalHost.", f"127.0.0.1:{port}", "127.0.0.5", f"[::1]:{port}"):
            assert _status_with_host(port, host, "/healthz") == (200, b"ok\n"), host
        assert _status_with_host(port, f"board.example:{port}", "/healthz")[0] == 200  # http.allowed_hosts
        assert _status_with_host(port, None, "/healthz")[0] == 200  # no Host: not a browser, nothing to rebind
        for host in (f"evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io", "10.1.2.3", "[::2]"):
            for path in ("/status.json", "/snapshot.jpg", "/stream.mjpg", "/metrics", "/healthz", "/"):
                status, body = _status_with_host(port, host, path)
                assert status == 421 and b"http.allowed_hosts" in body and b"\xff\xd8" not in body, (host, path, body)
        text = get(port, "/metrics")[2].decode()
        assert metric_value(text, "edged_http_refused_total", {"reason": "host"}) == 30
    finally:
        server.close()


def test_on_a_network_listen_the_address_asked_the_board_s_name_and_allowed_hosts_are_answered(tmp_path: Path) -> None:
    token = "0123456789abcdef0123456789abcdef"
    token_file = tmp_path / "http.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    cfg = HttpConfig(listen=f"0.0.0.0:{port}", token_file=token_file, allowed_hosts=["line3-pi.plant1.example", "10.9.8.7"])
    server = HttpServer(cfg, lambda: None, {"cam0": {}})
    server.start()
    try:
        assert serving(port)
        board = socket.gethostname()
        for host in ("127.0.0.1", "localhost", board, f"{board}.local", "line3-pi.plant1.example", "10.9.8.7"):
            assert _status_with_host(port, f"{host}:{port}", f"/healthz?token={token}") == (200, b"ok\n"), host
        status, body = _status_with_host(port, f"evil.example:{port}", f"/healthz?token={token}")
        assert status == 421 and b"http.allowed_hosts" in body
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this finds the address of the default route
            address = probe.getsockname()[0]
        assert _status_with_host(port, f"{address}:{port}", f"/healthz?token={token}", connect=address)[0] == 200
        assert _status_with_host(port, f"{address}:{port}", f"/healthz?token={token}")[0] == 421  # asked of 127.0.0.1
    finally:
        server.close()


def test_history_json_answers_a_reversed_range_400_and_an_endless_age_or_a_row_edited_by_hand_200(
    tmp_path: Path,
) -> None:
    """An age past what a float holds (OverflowError) and a message that is not JSON (a hand-edited
    journal) dropped the connection with a traceback in the daemon's log; a reversed range gave []."""
    journal = tmp_path / "journal.sqlite"
    store = JournalStore(journal, "normal")
    message = [json.dumps({"kind": "verdict", "frame_id": n}).encode() for n in range(3)]
    rows = [Entry("verdict", "cam0", n, n, f"P-{n}", "ok", "[]", n, n, "ab" * 32, "cd" * 32, message[n]) for n in range(3)]
    store.append(rows, Identity("b0a4d1d000000000", "boot-1", "9.9.9"), True)
    store.close()
    with sqlite3.connect(journal) as db:
        db.execute("UPDATE entries SET message = 'not json' WHERE frame_id = 1")
    db.close()
    port = free_port()
    server = HttpServer(HttpConfig(listen=f"127.0.0.1:{port}"), lambda: None, {"cam0": {}})
    server.journal = journal
    server.start()
    try:
        assert serving(port)
        code, _, body = get(port, "/history.json?since=" + "9" * 400 + "d")  # before 1970: every entry
        assert code == 200, body
        got = json.loads(body)
        assert [row["frame_id"] for row in got] == [0, 1, 2]
        assert (got[1]["message"], got[1]["unreadable"]) == (None, "its message is not JSON")
        assert got[2]["message"] == {"kind": "verdict", "frame_id": 2}
        code, _, body = get(port, "/history.json?since=5d&until=10d")
        assert code == 400 and "--since 5d is later than --until 10d" in json.loads(body)["error"]
    finally:
        server.close()
