"""The gstreamer source against real GStreamer pipelines: colours, files, end of stream, errors, `check` and `run`.

The pipelines are GStreamer's own ``videotestsrc`` (solid patterns, so a colour swap shows) and a
``filesrc`` of a video the tests write. The colour probe model calls a red frame "red", so a
detection from `edged run` proves frames went from GStreamer through the capture thread and the
model in the right colour order.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from allocations import NumpyAllocations
from daemon import RunningDaemon, free_port, run_cli, write_config, write_video
from onnx_models import LABELS, colour_probe
from waiting import wait_for

from edged.capture import Capture
from edged.errors import EXIT_CONFIG, ConfigError, SourceError
from edged.messages import DetectionsMessage
from edged.settings.sources import GstreamerSourceConfig
from edged.sources.gstreamer import GstreamerSource
from edged.sources.registry import config_problems, open_source

pytestmark = pytest.mark.integration

RED_BGR, BLUE_BGR = (0, 0, 255), (255, 0, 0)
LIVE_RED = "videotestsrc is-live=true pattern=red ! video/x-raw,width=128,height=96,framerate=20/1"


def source(pipeline: str, channel_order: Literal["bgr", "rgb"] = "bgr", **keys: Any) -> GstreamerSource:
    return GstreamerSource(GstreamerSourceConfig(pipeline=pipeline, channel_order=channel_order, **keys))


@pytest.fixture
def opened() -> Iterator[list[GstreamerSource]]:
    sources: list[GstreamerSource] = []
    yield sources
    for s in sources:
        s.close()


@pytest.fixture
def captures() -> Iterator[list[Capture]]:
    started: list[Capture] = []
    yield started
    for c in started:
        c.stop()


def capture(captures: list[Capture], pipeline: str, **keys: Any) -> Capture:
    cfg = GstreamerSourceConfig(pipeline=pipeline, **keys)
    c = Capture(lambda: open_source(cfg), "cam0", backoff_initial_s=0.05, backoff_max_s=0.1, decode_all=True)
    captures.append(c)
    c.start()
    return c


@pytest.mark.parametrize(("order", "expected"), [("bgr", [0, 0, 255]), ("rgb", [255, 0, 0])])
def test_a_red_test_pattern_arrives_in_the_configured_channel_order(
    opened: list[GstreamerSource], order: Literal["bgr", "rgb"], expected: list[int]
) -> None:
    # 65 pixels of 3 bytes: GStreamer pads each row to 196 bytes, which the copy must skip.
    s = source("videotestsrc pattern=red ! video/x-raw,width=65,height=31", order)
    opened.append(s)
    s.open()
    out = np.zeros((31, 65, 3), np.uint8)
    frame = s.read(out)
    assert frame is out
    assert (frame.reshape(-1, 3) == expected).all()


@pytest.mark.parametrize("width", [64, 65])  # rows packed, and rows padded to 4 bytes
def test_reading_into_the_slot_creates_no_array_per_frame(opened: list[GstreamerSource], width: int) -> None:
    counter = NumpyAllocations.get()
    assert counter is not None
    s = source(f"videotestsrc pattern=red ! video/x-raw,width={width},height=48")
    opened.append(s)
    s.open()
    out = np.zeros((48, width, 3), np.uint8)
    assert s.read(out) is out
    with counter.counting():
        before = counter.buffers
        for _ in range(5):
            assert s.grab()
            assert s.retrieve(out) is out
        assert counter.buffers == before
    assert (out.reshape(-1, 3) == RED_BGR).all()


def test_a_frame_of_another_size_comes_back_in_a_new_array(opened: list[GstreamerSource]) -> None:
    s = source("videotestsrc pattern=blue ! video/x-raw,width=64,height=48")
    opened.append(s)
    s.open()
    out = np.zeros((10, 10, 3), np.uint8)
    frame = s.read(out)
    assert frame is not None and frame is not out and frame.shape == (48, 64, 3)
    assert (frame.reshape(-1, 3) == BLUE_BGR).all()


def test_a_video_file_plays_through_the_capture_thread_at_its_rate_to_its_end(
    tmp_path: Path, captures: list[Capture]
) -> None:
    clip = write_video(tmp_path / "clip.avi", [RED_BGR] * 10 + [BLUE_BGR] * 10, fps=10)
    c = capture(captures, f"filesrc location={clip} ! decodebin")
    colours = []
    while (frame := c.take(timeout_s=10)) is not None:
        mean = frame.image.reshape(-1, 3).mean(axis=0)
        # JPEG rounding aside, every frame is one of the two colours written, in BGR order.
        assert np.allclose(mean, RED_BGR, atol=8) or np.allclose(mean, BLUE_BGR, atol=8), mean
        colours.append("red" if mean[2] > mean[0] else "blue")
    assert c.stats().state == "ended"
    # The appsink keeps the file's clock, so one second of each colour is there, red first.
    assert colours[0] == "red" and colours[-1] == "blue", colours
    assert colours == sorted(colours, key=["red", "blue"].index)


def test_end_of_stream_ends_the_capture(captures: list[Capture]) -> None:
    c = capture(captures, "videotestsrc num-buffers=3 pattern=red ! video/x-raw,width=32,height=32")
    assert wait_for(lambda: c.stats().state == "ended", timeout_s=10), c.stats()
    assert c.stats().frames_captured >= 1
    assert c.stats().reconnects == 0


def test_an_error_mid_stream_is_a_lost_camera_with_gstreamers_message_then_reopened(captures: list[Capture]) -> None:
    c = capture(captures, "videotestsrc is-live=true ! video/x-raw,width=32,height=32 ! identity name=breaks error-after=5")
    first = c.take(timeout_s=10)
    assert first is not None
    assert wait_for(lambda: c.stats().reconnects >= 1, timeout_s=10), c.stats()
    stats = c.stats()
    assert stats.last_error is not None and "GStreamer pipeline failed: breaks:" in stats.last_error
    assert wait_for(lambda: c.stats().state == "ok", timeout_s=10), c.stats()
    later = c.take(timeout_s=10)
    assert later is not None and later.frame_id > first.frame_id


def test_a_pipeline_that_goes_silent_is_lost_after_the_read_timeout(captures: list[Capture]) -> None:
    # The valve lets nothing through: the pipeline plays and never delivers a frame.
    c = capture(captures, "videotestsrc is-live=true ! valve drop=true", open_timeout_s=0.5, read_timeout_s=0.5)
    assert wait_for(lambda: c.stats().reconnects >= 1, timeout_s=10), c.stats()
    assert c.stats().last_error == "the GStreamer pipeline delivered no frame for 0.5 s"


def test_a_file_gstreamer_cannot_decode_is_a_source_error_naming_why(tmp_path: Path, opened: list[GstreamerSource]) -> None:
    garbage = tmp_path / "garbage.avi"
    garbage.write_text("not a video at all\n" * 100)
    s = source(f"filesrc location={garbage} ! decodebin")
    opened.append(s)
    with pytest.raises(SourceError, match=r"decodebin\d+: This appears to be a text file"):
        s.open()
        s.read(None)


def test_a_pipeline_that_does_not_parse_or_has_no_appsink_to_read_is_a_config_problem() -> None:
    assert config_problems(GstreamerSourceConfig(pipeline="videotestsrc ! nosuchelement")) == [
        'source.pipeline: GStreamer cannot parse it: no element "nosuchelement"'
    ]
    assert config_problems(GstreamerSourceConfig(pipeline="videotestsrc ! appsink videotestsrc ! appsink")) == [
        "source.pipeline has 2 appsinks: name the one edged reads 'name=edged'"
    ]
    assert config_problems(GstreamerSourceConfig(pipeline="videotestsrc ! fakesink name=edged videotestsrc ! appsink")) == [
        "source.pipeline: the element named 'edged' is not an appsink"
    ]
    assert config_problems(GstreamerSourceConfig(pipeline="videotestsrc")) == []


def test_a_pipeline_ending_in_a_sink_of_its_own_is_refused_naming_the_sink_and_the_remedy() -> None:
    # A gst-launch-1.0 line ends in a sink; GStreamer only said "could not link fakesink0 to videoconvert0".
    assert config_problems(GstreamerSourceConfig(pipeline="videotestsrc ! videoconvert ! fakesink sync=false")) == [
        "source.pipeline ends in fakesink, a sink edged cannot take frames from: leave it out (edged then ends "
        "the pipeline in an appsink of its own) or end it in `appsink name=edged`"
    ]


def test_caps_the_appsink_cannot_take_are_a_source_error_saying_how_to_convert(opened: list[GstreamerSource]) -> None:
    # GStreamer's own words were only "Internal data stream error. (streaming stopped, reason not-negotiated (-4))".
    s = source("videotestsrc ! video/x-raw,format=I420,width=64,height=48 ! appsink name=edged")
    opened.append(s)
    with pytest.raises(SourceError) as failed:
        s.open()
        s.read(None)
    assert "not-negotiated (-4)): two linked elements agree on no format" in str(failed.value), failed.value
    assert "put `videoconvert !` before it" in str(failed.value), failed.value


def test_a_pipeline_with_two_unnamed_appsinks_is_refused_at_open_too(opened: list[GstreamerSource]) -> None:
    s = source("videotestsrc ! appsink videotestsrc ! appsink")
    opened.append(s)
    with pytest.raises(ConfigError, match="name=edged"):
        s.open()


def test_frames_in_another_colour_order_than_configured_are_refused(opened: list[GstreamerSource]) -> None:
    s = source("videotestsrc ! videoconvert ! appsink name=edged caps=video/x-raw,format=RGB", "bgr")
    opened.append(s)
    s.open()
    with pytest.raises(SourceError, match=re.escape("delivers RGB frames but source.channel_order is 'bgr'")):
        s.read(None)


def test_frames_over_the_limit_are_refused_from_their_caps_before_they_are_copied(opened: list[GstreamerSource]) -> None:
    # 65536x2 is within the pixels but a side past what edged takes; before, each frame was copied out and planned for.
    s = source("videotestsrc pattern=black ! video/x-raw,format=BGR,width=65536,height=2 ! appsink name=edged")
    opened.append(s)
    s.open()
    assert s.grab()
    with pytest.raises(SourceError, match=re.escape("delivers frames of 65536x2 pixels, a side longer than the 65535")):
        s.retrieve(None)


def config(tmp_path: Path, pipeline: str) -> tuple[Path, str]:
    colour_probe(tmp_path / "probe.onnx")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc = {
        "source": {"type": "gstreamer", "pipeline": pipeline},
        "model": {"path": "probe.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
        "thermal": {"enabled": False},
    }
    return write_config(tmp_path / "edged.toml", doc), endpoint


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_bad_pipeline_string_exits_78_with_gstreamers_parse_error(tmp_path: Path, command: str) -> None:
    path, _ = config(tmp_path, "videotestsrc ! nosuchelement")
    result = run_cli(command, "--config", str(path))
    assert result.returncode == EXIT_CONFIG, (result.stdout, result.stderr)
    assert 'no element "nosuchelement"' in result.stdout + result.stderr


def test_missing_gstreamer_exits_78_saying_what_to_install(tmp_path: Path) -> None:
    path, _ = config(tmp_path, LIVE_RED)
    # A gi package that cannot be imported, first on the path: PyGObject as if not installed.
    hidden = tmp_path / "no-pygobject"
    (hidden / "gi").mkdir(parents=True)
    (hidden / "gi" / "__init__.py").write_text("raise ImportError('No module named gi')\n")
    pythonpath = os.pathsep.join(p for p in (str(hidden), os.environ.get("PYTHONPATH")) if p)
    result = run_cli("run", "--config", str(path), env={"PYTHONPATH": pythonpath})
    assert result.returncode == EXIT_CONFIG, (result.stdout, result.stderr)
    assert "source.type: the gstreamer source needs GStreamer and PyGObject" in result.stderr
    assert "gir1.2-gstreamer-1.0" in result.stderr and "No module named gi" in result.stderr


def test_check_names_a_pipeline_that_cannot_start_with_credentials_masked(tmp_path: Path) -> None:
    secret = "s3cret-pw"
    path, _ = config(tmp_path, f"rtspsrc location=rtsp://viewer:{secret}@127.0.0.1:{free_port()}/cam ! decodebin")
    result = run_cli("check", "--config", str(path))
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert re.search(r"gave no frame: GStreamer pipeline failed to start: rtspsrc\d+: Could not open", result.stderr)
    assert "pipeline=rtspsrc location=rtsp://***@127.0.0.1:" in result.stderr
    assert secret not in result.stdout + result.stderr


def test_check_opens_the_pipeline_and_reports_what_it_delivers(tmp_path: Path) -> None:
    path, _ = config(tmp_path, LIVE_RED)
    result = run_cli("check", "--config", str(path))
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert f"source     gstreamer pipeline={LIVE_RED} open_timeout_s=20.0 read_timeout_s=5.0" in result.stdout
    line = next(line for line in result.stdout.splitlines() if "delivers" in line)
    assert line.startswith("           delivers 128x96 at ") and line.endswith(
        " fps (measured), channel order bgr (declared: source.channel_order)"
    )
    assert float(line.split(" at ")[1].split()[0]) == pytest.approx(20, rel=0.35)


def test_edged_run_turns_a_live_test_pattern_into_detections_for_seconds_and_stops_cleanly(tmp_path: Path) -> None:
    # GStreamer loads libunwind into the process before ONNX Runtime; without libgcc_s made global
    # first, ORT's first exception inside a run aborts the daemon at its first frame.
    path, endpoint = config(tmp_path, LIVE_RED)
    daemon = RunningDaemon(path, endpoint)
    try:
        msgs: list[DetectionsMessage] = []
        for msg in daemon.messages(timeout=60):
            if isinstance(msg, DetectionsMessage):
                msgs.append(msg)
                if msg.capture_time_ns - msgs[0].capture_time_ns >= 3_000_000_000:
                    break
        assert msgs and msgs[-1].capture_time_ns - msgs[0].capture_time_ns >= 3_000_000_000, daemon.log()
        for msg in msgs:
            assert msg.frame_size == (128, 96)
            assert [d.label for d in msg.detections] == [LABELS[0]], msg
        ids = [m.frame_id for m in msgs]
        assert ids == sorted(set(ids))
        daemon.signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=10) == 0, daemon.log()
    finally:
        daemon.close()
