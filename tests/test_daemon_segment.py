"""A segmentation model on the running daemon: outlines and sizes over ZeroMQ, evidence as segmentation labels."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
from daemon import RunningDaemon, free_port, images_config, refused_by_check_and_run, run_cli, write_config
from images import black_png, lying_jpeg
from test_segment import GREY, fragmented_seg_export, spoiled_prototypes

from edged.config import ModelConfig, RuntimeConfig
from edged.messages import DetectionsMessage, StatusMessage
from edged.model import load_model
from edged.pipeline import FramePipeline
from edged.segment import Instances
from edged.tools.evaluate import read_yolo_outlines

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data" / "tasks"
REFERENCE = np.load(DATA / "seg.npz")


def test_a_segmentation_model_publishes_outlines_in_mm_and_saves_polygon_labels(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(
        tmp_path,
        DATA / "seg.onnx",
        [DATA / "tall.png"],
        endpoint,
        model={"iou": 0.7, "max_det": 300},
        inspect={"mm_per_px": 0.5},
        evidence={"dir": "evidence", "save": "ng"},
    )
    d = RunningDaemon(config, endpoint)
    try:
        msg = next(m for m in d.collect("detections", 1) if isinstance(m, DetectionsMessage))
        assert msg.task == "segment" and msg.verdict == "ng"
        assert [x.class_id for x in msg.detections] == REFERENCE["tall/cls"].tolist()
        for i, found in enumerate(msg.detections):
            expected = REFERENCE[f"tall/polygon{i}"]
            assert found.polygon is not None and np.allclose(found.polygon, expected, atol=0.5)
            assert found.area_px is not None and found.area_mm2 == pytest.approx(found.area_px * 0.25, abs=1e-2)
        d.wait_status(lambda s: s.evidence is not None and s.evidence.saved >= 1)
        label = next((tmp_path / "evidence").rglob("labels/*.txt")).read_text().splitlines()
        assert len(label) == len(msg.detections)
        first = [float(v) for v in label[0].split()]
        assert first[0] == msg.detections[0].class_id and len(first) == 1 + 2 * len(msg.detections[0].polygon or [])
    finally:
        d.stop()


def test_max_masks_past_what_a_4k_frame_can_hold_is_refused_with_exit_78_not_a_memory_error(tmp_path: Path) -> None:
    # 10000 masks of a 3840x2160 camera's frames are 77 GiB: said, naming the key, before any is made;
    # systemd does not restart a daemon for it (before: numpy's allocation error, a traceback, exit 1).
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic", "width": 3840, "height": 2160, "fps": 10.0},
            "model": {"path": str(DATA / "seg.onnx"), "max_masks": 10000},
            "publish": {"endpoints": [endpoint]},
            "thermal": {"enabled": False},
        },
    )
    for said in refused_by_check_and_run(config, endpoint):
        assert "model.max_masks = 10000" in said and "3840x2160" in said and "GiB of mask buffers" in said
        assert "set model.max_masks to 129 or less" in said and "Traceback" not in said


def test_a_bomb_and_an_image_too_large_for_the_masks_are_skipped_and_counted_between_good_images(
    tmp_path: Path,
) -> None:
    # b.jpg, 675 bytes, claims 20000x20000: 1.2 GB decoded (2.3 GB at OpenCV's peak), refused before it
    # is. c.png, 7680x4320, is read, but its 40 masks would need 1.2 GiB: skipped and counted (before:
    # exit 78, which systemd does not restart, so one file dropped into the folder stopped the line).
    made = tmp_path / "made"
    made.mkdir()
    shutil.copy(DATA / "tall.png", made / "a.png")
    lying_jpeg(made / "b.jpg", 20000, 20000)
    black_png(made / "c.png", 7680, 4320)
    shutil.copy(DATA / "wide.png", made / "d.png")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    images = [made / name for name in ("a.png", "b.jpg", "c.png", "d.png")]
    config = images_config(tmp_path, DATA / "seg.onnx", images, endpoint, source={"pace": False}, model={"max_masks": 40})
    d = RunningDaemon(config, endpoint)
    try:
        published: set[str | None] = set()
        counted = False  # b.jpg as an unreadable image, c.png as a frame of a size the model cannot take
        for msg in d.messages(60):
            if isinstance(msg, DetectionsMessage):
                published.add(msg.source_file)
            elif isinstance(msg, StatusMessage):
                counted = bool(msg.drops.get("unreadable_image") and msg.drops.get("bad_frame_size"))
                if counted and {"a.png", "d.png"} <= published:
                    break
        assert counted and published == {"a.png", "d.png"}, d.log()
        status = Path(f"/proc/{d.proc.pid}/status").read_text().splitlines()
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        assert d.proc.poll() is None
        logged = d.log()
    finally:
        d.stop()
    assert peak_kb < 600_000, peak_kb  # far below b.jpg's 1.2 GB: it was never decoded
    [bomb] = [line for line in logged.splitlines() if "b.jpg" in line]
    assert "its JPEG header claims 20000x20000 pixels, over the 33177600 pixels (7680x4320) edged decodes" in bomb
    [large] = [line for line in logged.splitlines() if "rejected (size)" in line]
    assert "c.png: model.max_masks = 40 would need 1.2 GiB of mask buffers for 7680x4320 frames" in large
    assert "Traceback" not in logged


def test_nan_prototypes_make_the_frame_uncertain_counted_and_logged_not_an_ok_part(tmp_path: Path) -> None:
    # Every mask made from them is empty, so every detection was dropped and the part passed as OK.
    (tmp_path / "made").mkdir()
    model = spoiled_prototypes(tmp_path / "made" / "nan.onnx", math.nan)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(tmp_path, model, [DATA / "tall.png"], endpoint, inspect={"mm_per_px": 0.5})
    checked = run_cli("check", "--config", str(config))
    assert checked.returncode == 78 and "NaN or infinite output value(s)" in checked.stderr, checked.stderr
    d = RunningDaemon(config, endpoint)
    try:
        msg = next(m for m in d.collect("detections", 1) if isinstance(m, DetectionsMessage))
        assert msg.verdict == "uncertain" and msg.detections == []
        d.wait_status(lambda s: s.drops.get("nonfinite_output", 0) >= 1)
        assert "NaN or infinite value(s)" in d.log() and d.proc.poll() is None
    finally:
        d.close()


def test_masks_in_hundreds_of_pieces_are_published_thinned_counted_logged_once_and_labelled(tmp_path: Path) -> None:
    # Each of the 20 masks was outlined in about 15000 points: a 5 MB message a frame, which edged's own
    # subscribers refuse (over 1 MiB) and publish.hwm times over held for a slow subscriber, an evidence
    # label as large, and most of a second a frame joining the pieces.
    (tmp_path / "made").mkdir()
    model = fragmented_seg_export(tmp_path / "made" / "fragmented.onnx", classes=20)
    cv2.imwrite(str(tmp_path / "made" / "grey.png"), GREY)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(
        tmp_path, model, [tmp_path / "made" / "grey.png"], endpoint, evidence={"dir": "evidence", "save": "all"}
    )
    d = RunningDaemon(config, endpoint)
    try:
        msg = next(m for m in d.collect("detections", 1) if isinstance(m, DetectionsMessage))
        points = [len(found.polygon or []) for found in msg.detections]
        assert len(points) == 20 and all(1000 < n <= 2000 for n in points), points
        assert len(msg.model_dump_json()) < 20 * 2000 * 16 + 20 * 300  # 16 bytes a point at most, and the rest
        # The areas are the whole masks', whatever the bound.
        cfg = ModelConfig(path=model, max_outline_points=5000)
        whole, _ = FramePipeline(load_model(cfg, RuntimeConfig()), 640, 360, "bgr").process(GREY)
        assert isinstance(whole, Instances)
        assert [found.area_px for found in msg.detections] == list(whole.area_px)
        d.wait_status(lambda s: s.drops.get("outline_thinned", 0) >= 3 and s.evidence is not None and s.evidence.saved >= 1)
        log = d.log()
        assert log.count("outline(s) on frame") == 1, log  # one line per burst, then the counter
        assert "20 outline(s)" in log and "raise model.max_outline_points" in log and d.proc.poll() is None
        label = next((tmp_path / "evidence").rglob("labels/*.txt"))
        _, classes, outlines = read_yolo_outlines(label, 640, 360, 20)
        assert sorted(classes.tolist()) == list(range(20)) and all(1000 < len(o) <= 2000 for o in outlines)
    finally:
        d.stop()
