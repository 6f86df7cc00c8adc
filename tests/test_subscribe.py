"""``edged subscribe`` stops by itself once every camera it follows has ended: against a real daemon
playing a finite image folder, and against a publisher whose cameras end one after the other."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import pytest
import zmq
from daemon import edged_command, free_port, write_config
from onnx_models import colour_probe
from waiting import wait_for

from edged import subscribe
from edged.errors import TriggerFailed
from edged.messages import (
    AnomalyRegion,
    CaptureState,
    Detection,
    DetectionsMessage,
    ModelInfo,
    StatusMessage,
    Timings,
    TopClass,
    TriggerError,
)
from edged.subscribe import format_message, run_subscribe
from edged.trigger import run_trigger

pytestmark = pytest.mark.integration

MODEL = ModelInfo(name="probe", sha256="ab" * 32, provider="CPUExecutionProvider")


@dataclass(frozen=True)
class Played:
    """What `_subscriber_first`'s subscriber printed and how both ended."""

    out: str
    err: str
    subscriber_rc: int
    daemon_log: str
    daemon_rc: int


def _subscriber_first(tmp_path: Path, source: dict[str, object], publish: dict[str, object], images: list[str]) -> Played:
    """``edged subscribe``, then ``edged run`` on a folder of ``images`` read by ``source``, as the docs
    order them; what each printed and how each ended."""
    colour_probe(tmp_path / "probe.onnx")
    (tmp_path / "imgs").mkdir()
    for name in images:
        cv2.imwrite(str(tmp_path / "imgs" / name), np.full((48, 64, 3), (0, 0, 255), np.uint8))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "images", "path": "imgs", "loop": False, **source},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [endpoint], **publish},
            "thermal": {"enabled": False},
            "http": {"listen": ""},
        },
    )
    subscriber = subprocess.Popen(
        edged_command("subscribe", endpoint, "--timeout", "120"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    daemon = subprocess.Popen(edged_command("run", "--config", str(config)), stderr=subprocess.PIPE, text=True)
    try:
        out, err = subscriber.communicate(timeout=150)
        daemon_log = daemon.communicate(timeout=30)[1]
    finally:
        for proc in (subscriber, daemon):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return Played(out, err, subscriber.returncode, daemon_log, daemon.returncode)


def test_it_exits_0_once_the_daemon_has_played_a_finite_source_to_its_end(tmp_path: Path) -> None:
    # The subscriber first: it connects as soon as the daemon binds, seconds before the images run out.
    # The last images' names would retitle the terminal's window and clear its screen, printed as they are.
    images = [f"{i:03d}.png" for i in range(10)] + [f"{i:03d}\x1b]0;edged\x07\x1b[2J.png" for i in range(10, 13)]
    p = _subscriber_first(tmp_path, {"fps": 3.0}, {"status_interval_s": 0.5}, images)
    ended = re.search(r"INFO .*source ended: stopping \((\d+) frames processed\)", p.daemon_log)
    assert p.daemon_rc == 0 and ended is not None and int(ended[1]) > 0, p.daemon_log
    assert p.subscriber_rc == 0, p.err
    assert "[cam0 frame " in p.out and "camera ended" in p.out  # the detections, then the last status
    assert re.search(r"\[cam0 frame \d+ \d{3}\.png\]", p.out), p.out  # which image gave each
    assert re.search(r" 01\d\\x1b]0;edged\\x07\\x1b\[2J\.png\]", p.out) and "\x1b" not in p.out + p.err, p.out
    assert "every camera has ended (cam0): the stream is over" in p.err
    assert "no more messages within" not in p.err


def test_started_first_it_hears_every_image_of_a_folder_read_as_fast_as_the_model_goes(tmp_path: Path) -> None:
    """As the docs say: the subscriber first, then ``edged run`` on a folder with ``pace = false``.
    Every image went out within milliseconds of the bind, before the subscriber's next connection
    attempt: it heard nothing, and waited on; edged now hears the subscribers waiting first."""
    names = [f"{i:03d}.png" for i in range(6)]
    p = _subscriber_first(tmp_path, {"pace": False}, {"publish_empty": True}, names)
    assert p.daemon_rc == 0, p.daemon_log
    assert re.findall(r"\[cam0 frame \d+ (\d{3}\.png)\]", p.out) == names, p.out + p.err
    assert p.subscriber_rc == 0 and "every camera has ended (cam0)" in p.err, p.err


def _status(camera: str, state: CaptureState, seq: int) -> list[bytes]:
    msg = StatusMessage(
        camera_id=camera,
        seq=seq,
        time_ns=0,
        uptime_s=1.0,
        fps=0.0,
        frames_processed=0,
        source_state=state,
        drops={},
        latency={},
        rate_cap_fps=None,
        thermal=None,
        model=MODEL,
    )
    return [f"edged/status/{camera}".encode(), msg.model_dump_json().encode()]


@contextmanager
def subscribing(
    tmp_path: Path, count: int | None, timeout_s: float
) -> Iterator[tuple[zmq.Socket[bytes], _Lines, list[int], threading.Thread]]:
    """A PUB socket of the test's, with `run_subscribe` on it in a thread, its subscription received:
    the socket, what the subscriber printed, its exit code once it has one, and its thread."""
    endpoint = f"ipc://{tmp_path / 'pub.sock'}"
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)
    pub.bind(endpoint)
    codes: list[int] = []
    out = _Lines()
    subscriber = threading.Thread(
        target=lambda: codes.append(
            run_subscribe(endpoint, "", stats=False, raw_json=False, count=count, timeout_s=timeout_s, out=out)
        )
    )
    subscriber.start()
    try:
        assert pub.poll(30_000) and pub.recv() == b"\x01", "the subscription"
        yield pub, out, codes, subscriber
    finally:
        pub.close(linger=0)
        subscriber.join(timeout_s + 10)
        context.term()


def test_one_camera_ended_among_running_ones_keeps_it_going_until_every_one_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with subscribing(tmp_path, count=None, timeout_s=120) as (pub, out, codes, subscriber):
        pub.send_multipart(_status("top", "ended", 0))  # what a subscriber joining late may hear first
        pub.send_multipart(_status("side", "ok", 0))
        assert wait_for(lambda: "[status side] 0.0 fps, camera ok" in out.text(), timeout_s=30), out.text()
        for seq in range(1, 4):  # status rounds, the side camera still running
            pub.send_multipart(_status("top", "ended", seq))
            pub.send_multipart(_status("side", "ok", seq))
            assert wait_for(lambda s=seq: out.text().count("[status side]") == s + 1, timeout_s=30), out.text()
        assert subscriber.is_alive() and not codes
        pub.send_multipart(_status("side", "ended", 4))
        subscriber.join(60)
        assert not subscriber.is_alive() and codes == [0]
        assert "every camera has ended (top, side): the stream is over" in capsys.readouterr().err


def test_what_a_publisher_sends_reaches_the_terminal_escaped_and_a_lone_surrogate_is_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A publisher on the network (or a peer in the middle of a plaintext stream) chooses the camera
    ids and names ``edged subscribe`` prints: before, escape sequences reached the terminal as sent,
    and a ``\\udc80`` escape, accepted, could be neither printed on a UTF-8 terminal nor written
    with ``--json`` (a traceback)."""
    with subscribing(tmp_path, count=2, timeout_s=60) as (pub, out, codes, subscriber):
        topic, payload = _status("top\x1b]0;owned\x07\u202e", "ok", 0)
        pub.send_multipart([topic, payload])
        pub.send_multipart([b"edged/status/x", payload.replace(b"top\\u001b", b"x\\udc80\\u001b")])
        pub.send_multipart(_status("side", "ok", 0))
        subscriber.join(60)
        assert not subscriber.is_alive() and codes == [0]
        assert out.text() == (
            "[status top\\x1b]0;owned\\x07\\u202e] 0.0 fps, camera ok, thermal off, 0 frames, drops: none\n"
            "[status side] 0.0 fps, camera ok, thermal off, 0 frames, drops: none\n"
        ), out.text()
        assert "rejected 1 message(s); last: payload holds a lone surrogate" in capsys.readouterr().err


def test_a_request_servers_words_reach_the_terminal_escaped(tmp_path: Path) -> None:
    """``edged trigger`` says why no verdict came in the server's own words: before, as sent."""
    endpoint = f"ipc://{tmp_path / 'trigger.sock'}"
    context = zmq.Context()
    server = context.socket(zmq.REP)
    server.bind(endpoint)
    answered: list[bytes] = []

    def answer() -> None:
        if server.poll(30_000):
            answered.append(server.recv())
            error = TriggerError(camera_id="top", part_id="P-1", error="busy", detail="full\x1b[2J\nedged: forged")
            server.send(error.model_dump_json().encode())

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(TriggerFailed) as failed:
            run_trigger(endpoint, "P-1", 30, camera_id="top")
        assert str(failed.value) == "no verdict (busy): full\\x1b[2J\\nedged: forged"
        assert answered
    finally:
        thread.join(40)
        server.close(linger=0)
        context.term()


class _Lines:
    """What ``edged subscribe`` prints, for the test's thread to read while it runs."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._lines.append(text)
        return len(text)

    def flush(self) -> None:
        return None

    def text(self) -> str:
        with self._lock:
            return "".join(self._lines)


@pytest.mark.integration
def test_a_reader_that_stops_early_ends_it_quietly(tmp_path: Path) -> None:
    """`edged subscribe ... | head`: a BrokenPipeError traceback, and the subscriber went on."""
    endpoint = f"ipc://{tmp_path / 'pub.sock'}"
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)
    pub.bind(endpoint)
    proc = subprocess.Popen(
        edged_command("subscribe", endpoint, "--json"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert pub.poll(30_000) and pub.recv() == b"\x01", "the subscription"
        assert proc.stdout is not None and proc.stderr is not None
        pub.send_multipart(_status("top", "ok", 0))
        assert proc.stdout.readline().startswith("{")
        proc.stdout.close()
        seq = 1
        while proc.poll() is None and seq < 100_000:  # until a write finds the pipe closed
            pub.send_multipart(_status("top", "ok", seq))
            seq += 1
            if seq % 100 == 0:
                time.sleep(0.01)  # the subscriber's queue holds a bounded number
        err = proc.stderr.read()
        assert (proc.wait(60), err) == (0, "")
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        pub.close(linger=0)
        context.term()


@pytest.mark.integration
def test_ctrl_c_ends_it_with_exit_0_and_nothing_said(tmp_path: Path) -> None:
    """Ctrl-C is how one stops it, as mosquitto_sub: exit 0, which a script piping it reads as done
    (docs/commands.md); so it is while its modules load (tests/test_cli.py)."""
    endpoint = f"ipc://{tmp_path / 'pub.sock'}"
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)
    pub.bind(endpoint)
    proc = subprocess.Popen(edged_command("subscribe", endpoint), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert pub.poll(30_000) and pub.recv() == b"\x01", "the subscription"
        assert proc.stdout is not None
        pub.send_multipart(_status("top", "ok", 0))
        assert proc.stdout.readline().startswith("[status top]")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert (proc.returncode, out, err) == (0, "", "")
    finally:
        proc.kill()
        proc.communicate()
        pub.close(linger=0)
        context.term()


def test_nothing_heard_at_all_is_said_once_while_it_listens_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong address or port: before, it waited in silence for ever."""
    monkeypatch.setattr(subscribe, "SILENCE_S", 0.5)
    endpoint = f"ipc://{tmp_path / 'nobody.sock'}"
    assert run_subscribe(endpoint, "", stats=False, raw_json=False, count=None, timeout_s=2.0) == 1
    err = capsys.readouterr().err
    assert err.count(f"nothing received from {endpoint} in 0.5 s") == 1, err
    assert err.endswith("no more messages within 2 s\n"), err


def _frame_message(**fields: object) -> DetectionsMessage:
    return DetectionsMessage(
        camera_id="line",
        seq=7,
        frame_id=7,
        capture_time_ns=time.time_ns(),
        frame_size=(1280, 720),
        input_size=(320, 320),
        model=ModelInfo(name="m", sha256="ab" * 32, provider="CPUExecutionProvider"),
        timings=Timings(preprocess_ms=0.4, inference_ms=6.0, decode_ms=0.8, age_ms=9.0),
        thermal_state="ok",
        verdict="ng",
        **fields,  # type: ignore[arg-type]
    )


def test_a_line_says_what_each_task_found() -> None:
    """A classifier's and an anomaly model's frames have no detections: their lines said only
    "0 detection(s)", an NG among them with nothing to say why; a segmentation's defects had no size."""
    classify = _frame_message(
        task="classify",
        detections=[],
        top=[TopClass(class_id=c, label=label, score=p) for c, label, p in ((1, "ng", 0.91), (0, "ok", 0.09))],
    )
    assert "NG top: ng 0.91, ok 0.09  (6.0 ms inference" in format_message(classify)
    region = AnomalyRegion(box=(10, 20, 30, 40), area_px=300, max_score=0.8, polygon=[], length_px=20, width_px=20)
    anomaly = _frame_message(task="anomaly", detections=[], anomaly_score=0.68, threshold=0.31, regions=[region])
    assert "NG anomaly score 0.68 (threshold 0.31), 1 region(s): (10,20)-(30,40) 20x20 px" in format_message(anomaly)
    spot = Detection(
        class_id=1,
        label="spot",
        score=0.5,
        box=(0, 0, 9, 9),
        length_px=18,
        width_px=16,
        length_mm=0.9,
        width_mm=0.8,
        note="within limits",
    )
    scratch = Detection(class_id=0, label="scratch", score=0.81, box=(100, 50, 300, 90), length_px=210, width_px=12)
    segment = _frame_message(task="segment", detections=[scratch, spot])
    assert (
        "2 detection(s): scratch 0.81 (100,50)-(300,90) 210x12 px; spot 0.50 (0,0)-(9,9) 0.9x0.8 mm within limits"
        in format_message(segment)
    )
    fine = spot.model_copy(update={"length_mm": 0.018, "width_mm": 0.016})  # a scale of a micrometre per pixel
    assert "spot 0.50 (0,0)-(9,9) 0.018x0.016 mm" in format_message(_frame_message(task="segment", detections=[fine]))
    box = Detection(class_id=0, label="scratch", score=0.81, box=(100, 50, 300, 90))
    assert "NG 1 detection(s): scratch 0.81 (100,50)-(300,90)  (6.0" in format_message(_frame_message(detections=[box]))
