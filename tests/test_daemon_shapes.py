"""Frames of extreme shapes through the running daemon: images from 1x1 to 65535 pixels on a side among
ordinary ones, in one folder, through every stage to the messages, the evidence and the watched live view."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from daemon import RunningDaemon, free_port, images_config, run_cli, write_config
from jsonschema import Draft202012Validator
from test_http import Stream, decode, serving
from test_image_header import exif

import edged
from edged.messages import DetectionsMessage, StatusMessage, parse_message
from edged.tools.evaluate import label_path, read_yolo_outlines

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
# (width, height): a pixel, a few, odd sides, slivers each way, and the longest side edged reads, past
# the 65500 a JPEG holds, so the live view and the evidence cannot keep such a frame as it is.
SIZES = ((1, 1), (2, 2), (7, 13), (3, 5000), (5000, 3), (1, 65535), (65535, 2))
INSPECT = {"zones": {"left": [(0, 0), (0.5, 0), (0.5, 1), (0, 1)], "right": [(0.5, 0), (1, 0), (1, 1), (0.5, 1)]}}
MODELS = {
    "detect": (ROOT / "models" / "demo.onnx", {}, {}),
    "segment": (DATA / "tasks" / "seg.onnx", {"retina_masks": True}, {"max_length_mm": {"scratch": 1.0}}),
    "classify": (DATA / "tasks" / "cls.onnx", {}, {"zones": {}, "ng_classes": ["crack"]}),
    "anomaly": (DATA / "anomaly" / "padim.onnx", {}, {"max_area_mm2": {"anomaly": 1.0}}),
}


def no_constant(name: str) -> None:
    raise AssertionError(f"{name} in a message")


@pytest.mark.parametrize("task", list(MODELS))
def test_every_shape_is_published_and_saved_as_evidence_while_the_view_is_watched(tmp_path: Path, task: str) -> None:
    # Unpaced, every image is handed to the model in turn: paced, a model slower than the pace on some
    # sizes (replanned at each, past 4 sizes) can miss the same images on every pass.
    made = tmp_path / "made"
    made.mkdir()
    rng = np.random.default_rng(0)
    sizes = {"square.png": (200, 200)}
    for w, h in SIZES:
        cv2.imwrite(str(made / f"s_{w}x{h}.png"), rng.integers(0, 256, (h, w, 3), np.uint8))
        sizes[f"s_{w}x{h}.png"] = (w, h)
    model, keys, inspect = MODELS[task]
    endpoint, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    config = images_config(
        tmp_path,
        model,
        [*made.iterdir(), DATA / "tasks" / "square.png"],
        endpoint,
        source={"pace": False},
        model=keys,
        inspect={**INSPECT, "mm_per_px": 0.1, **inspect},
        evidence={"dir": "evidence", "save": "all", "max_per_minute": 0},
        http={"listen": f"127.0.0.1:{port}", "view_fps": 30},
    )
    validator = Draft202012Validator(json.loads((Path(edged.__file__).parent / "messages.schema.json").read_text()))
    shown: set[tuple[int, ...]] = set()
    failed: list[Exception] = []
    watching = threading.Event()

    def watch() -> None:
        try:
            stream = Stream(port)
            try:
                while not watching.is_set():
                    shown.add(decode(stream.next_jpeg()).shape)
            finally:
                stream.resp.close()
                stream.close()
        except (AssertionError, OSError) as e:  # a failure while the daemon runs; its end at the stop is none
            failed.append(e)

    viewer = threading.Thread(target=watch, daemon=True)
    d = RunningDaemon(config, endpoint)
    try:
        assert serving(port), d.log()
        viewer.start()
        published: dict[str, tuple[int, int]] = {}
        saved: set[str] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert d.proc.poll() is None, d.log()
            if not d.sub.poll(100):
                continue
            _, payload = d.sub.recv_multipart()
            document = json.loads(payload, parse_constant=no_constant)  # NaN and Infinity are no JSON
            assert not list(validator.iter_errors(document)), document
            msg = parse_message(payload)
            if isinstance(msg, DetectionsMessage) and msg.source_file:
                published[msg.source_file] = msg.frame_size
            elif isinstance(msg, StatusMessage) and msg.evidence is not None:
                assert msg.evidence.errors == 0, (msg.evidence.last_error, d.log())
                assert not {k: n for k, n in msg.drops.items() if n and k != "stale_slow"}, msg.drops
                saved = {json.loads(p.read_text())["source_file"] for p in (tmp_path / "evidence").rglob("messages/*.json")}
            assert not failed, failed
            if published == sizes and saved == set(sizes) and shown:
                break
        else:
            raise AssertionError(f"in 60 s: published {published}, saved {saved}, shown {shown}:\n{d.log()}")
        watching.set()
        assert d.stop() == 0
    finally:
        watching.set()
        d.close()
        if viewer.is_alive():
            viewer.join(timeout=30)  # its stream ends with the daemon
    names = json.loads(next((tmp_path / "evidence").rglob("dataset.json")).read_text())["names"]
    day = next((tmp_path / "evidence").rglob("messages")).parent
    for image in (p for p in (day / "images").rglob("*.*") if not p.name.startswith(".")):  # written last of a set
        w, h = sizes[json.loads((day / "messages" / f"{image.stem}.json").read_text())["source_file"]]
        assert image.suffix == (".png" if max(w, h) > 65500 else ".jpg")
        assert cv2.imread(str(image)).shape == (h, w, 3)
        if task != "classify":  # a classifier's folder is its label
            read_yolo_outlines(label_path(image), w, h, len(names))  # readable as ultralytics reads it
    log = d.log_path.read_text()
    assert "Traceback" not in log and "can't encode" not in log


def _viewed(tmp_path: Path, image: Path) -> tuple[RunningDaemon, int]:
    """The demo model's daemon on ``image`` alone, its live view on a free port: the daemon and the port."""
    endpoint, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    config = images_config(tmp_path, ROOT / "models" / "demo.onnx", [image], endpoint, http={"listen": f"127.0.0.1:{port}"})
    return RunningDaemon(config, endpoint), port


def test_a_watched_camera_of_frames_taller_than_a_jpeg_holds_is_shown_four_views_tall(tmp_path: Path) -> None:
    # 1x65535: narrower than the view, so not scaled to its width, and taller than the 65500 a JPEG holds.
    # The encoder's JPEG failed (OpenCV's error on stderr), and the stream sent nothing. Now at most four
    # times view_width (960 by default) tall: the page shows no more of it.
    (tmp_path / "made").mkdir()
    cv2.imwrite(str(tmp_path / "made" / "tall.png"), np.full((65535, 1, 3), 90, np.uint8))
    d, port = _viewed(tmp_path, tmp_path / "made" / "tall.png")
    try:
        assert serving(port), d.log()
        stream = Stream(port)
        try:
            shown = decode(stream.next_jpeg()).shape
        finally:
            stream.resp.close()
            stream.close()
    finally:
        d.close()
    assert shown == (4 * 960, 1, 3)
    assert "can't encode" not in d.log_path.read_text()


def test_the_page_shows_a_tall_frame_whole_within_the_window(tmp_path: Path) -> None:
    # A line-scan camera's strip, 1024x30000: its bottom tenth blue, which no box or banner is. The page
    # set the live image 640 wide and as tall as that made it, 18750 px: the window showed its top 3 %.
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (scripts/setup test installs it)"
    strip = np.full((30000, 1024, 3), 90, np.uint8)
    strip[27000:] = (255, 0, 0)
    (tmp_path / "made").mkdir()
    cv2.imwrite(str(tmp_path / "made" / "strip.png"), strip)
    d, port = _viewed(tmp_path, tmp_path / "made" / "strip.png")
    try:
        assert serving(port), d.log()
        d.collect("detections", 1)
        # Watched already, the view gives the page its latest frame at once: frames of 30 MB each, decoded
        # on a busy machine, the next one could come after chromium's time budget.
        watching = Stream(port)
        try:
            decode(watching.next_jpeg())
            png = tmp_path / "page.png"
            args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--timeout=10000"]
            url = f"http://127.0.0.1:{port}/"
            shot = subprocess.run(
                [*args, "--window-size=1000,640", f"--screenshot={png}", url], capture_output=True, timeout=60
            )
            assert png.is_file(), shot.stderr.decode()[-2000:]
        finally:
            watching.resp.close()
            watching.close()
    finally:
        d.close()
    page = cv2.imread(str(png)).astype(np.int32)
    blue = (page[..., 0] > 180) & (page[..., 1] < 70) & (page[..., 2] < 70)
    assert np.count_nonzero(blue) > 200, "the bottom of the frame is not in the window"
    assert blue.any(axis=1).nonzero()[0].max() < 640 - 8  # above the window's bottom edge, the frame's end in sight


def test_check_judges_a_phones_portrait_photo_by_the_size_it_is_decoded_at(tmp_path: Path) -> None:
    # Stored 120x60, turned a quarter by its EXIF orientation: decoded 60x120, which the classifier's region
    # does not fit, so run skips it and serves the next image. Check took it by its stored size, chose it,
    # decoded it and exited 78: a folder run serves refused.
    (tmp_path / "frames").mkdir()
    stored = cv2.imencode(".jpg", np.full((60, 120, 3), 90, np.uint8))[1].tobytes()
    (tmp_path / "frames" / "a_portrait.jpg").write_bytes(stored[:2] + exif(6) + stored[2:])
    cv2.imwrite(str(tmp_path / "frames" / "b_landscape.png"), np.full((60, 120, 3), 90, np.uint8))
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "images", "path": str(tmp_path / "frames")},
            "model": {"path": str(DATA / "tasks" / "cls.onnx")},
            "inspect": {"ng_classes": ["crack"], "roi": [0, 0, 100, 50]},
            "publish": {"endpoints": [f"tcp://127.0.0.1:{free_port()}"]},
            "thermal": {"enabled": False},
        },
    )
    checked = run_cli("check", "--config", str(config))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "run would skip 1 of the 2 images" in checked.stdout and "a 60x120 frame" in checked.stdout
    assert "first image that fits (b_landscape.png)" in checked.stdout
