"""The shadow trial on the running daemon: a candidate compared on live frames, promoted through its
gate (or by force), rolled back; one that fails to load, is unsigned or outputs NaN never touches
the live path."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import shutil
import signal
import sqlite3
import time
import urllib.request
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import zmq
from daemon import RunningDaemon, free_port, run_cli, write_config, write_video
from filesystems import opening_stalled
from floods import Flood
from onnx_models import failing_probe, fixed_scene, nan_probe
from test_signature import keypair
from waiting import wait_for

from edged.messages import DetectionsMessage, StatusMessage

pytestmark = pytest.mark.integration

SCENE = [
    (16.0, 20.0, 8.0, 8.0, 0, 0.9),  # scratch
    (48.0, 20.0, 8.0, 8.0, 1, 0.8),  # crack
    (16.0, 44.0, 8.0, 8.0, 2, 0.7),  # dust
]
SWAPPED = [(cx, cy, w, h, {0: 1, 1: 0}.get(cls, cls), score) for cx, cy, w, h, cls, score in SCENE]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def start(tmp_path: Path, candidate: dict[str, Any], *args: Any, **keys: Any) -> tuple[RunningDaemon, Path]:
    """`configure`'s daemon, running, and its configuration."""
    config, endpoint = configure(tmp_path, candidate, *args, **keys)
    return RunningDaemon(config, endpoint), config


def configure(
    tmp_path: Path,
    candidate: dict[str, Any],
    model: dict[str, Any] | None = None,
    colour: tuple[int, int, int] = (90, 90, 90),
    http: str = "",
    journal: str | None = None,
    trigger: dict[str, Any] | None = None,
) -> tuple[Path, str]:
    """``tmp_path/edged.toml``: the live model and ``candidate`` on a looping clip; returns it and its publish endpoint."""
    fixed_scene(tmp_path / "scene.onnx", SCENE)
    write_video(tmp_path / "clip.avi", [colour] * 10)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    control = f"ipc://{tmp_path}/control.sock"
    doc: dict[str, dict[str, Any]] = {
        "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
        "model": {"path": "scene.onnx", **(model or {})},
        "model.candidate": {"sample_every": 1, "min_frames": 5, "control": control, **candidate},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.3},
        "thermal": {"enabled": False},
        "http": {"listen": http},
    }
    if journal is not None:
        doc["journal"] = {"path": journal}
    if trigger is not None:
        doc["trigger"] = trigger
    return write_config(tmp_path / "edged.toml", doc), endpoint


def trial(d: RunningDaemon, frames: int = 5) -> StatusMessage:
    """The first status whose trial has compared ``frames`` frames."""
    return d.wait_status(lambda s: s.candidate is not None and s.candidate.frames >= frames, timeout=30)


def detections_from(d: RunningDaemon, sha: str, following: int = 3) -> list[DetectionsMessage]:
    """Once a detections message comes from the model ``sha``, it and the next ``following``: all must."""
    got: list[DetectionsMessage] = []
    for msg in d.messages(30):
        if isinstance(msg, DetectionsMessage) and (got or msg.model.sha256 == sha):
            got.append(msg)
            if len(got) > following:
                return got
    raise AssertionError(f"no detections from model {sha[:12]} in 30 s:\n{d.log()}")


def test_an_identical_candidate_agrees_on_every_frame_and_passes_the_gate(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "same.onnx", SCENE)
    port = free_port()
    d, config = start(tmp_path, {"path": "same.onnx", "evidence_dir": "disagree"}, http=f"127.0.0.1:{port}")
    try:
        status = trial(d)
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).read().decode()
        assert 'id="candidate"' in page
        served = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=10).read())
        assert served["candidate"]["state"] == "on_trial"
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "edged_candidate_frames_total" in metrics and "edged_candidate_gate_passed" in metrics
        report = status.candidate
        assert report is not None and report.state == "on_trial" and report.error is None
        assert report.agreement == 1.0 and report.gate is None and report.failed_frames == 0
        assert set(report.verdicts) == {"none/none"}
        assert {label: c.live_only + c.candidate_only for label, c in report.classes.items()} == {
            "scratch": 0,
            "crack": 0,
            "dust": 0,
        }
        assert report.score_shift == 0.0 and report.latency is not None and report.latency.p99_ms > 0
        assert report.disagreements_saved == 0 and not (tmp_path / "disagree").exists()
        assert report.live_frames > 0 and 0 <= report.live_delayed <= report.live_frames
        assert report.live_delay_ms is not None and report.live_delay_ms >= 0.0
        assert "edged_candidate_live_frames_total" in metrics
        done = run_cli("promote", "--config", str(config))
        assert done.returncode == 0, done.stderr
        assert "promoted" in done.stdout and sha256(tmp_path / "same.onnx") in done.stdout
        assert d.wait_status(lambda s: s.candidate is not None and s.candidate.state == "live").candidate is not None
    finally:
        d.stop()


def test_a_candidate_with_its_classes_swapped_is_refused_then_forced_and_rolled_back(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "swapped.onnx", SWAPPED)
    d, config = start(tmp_path, {"path": "swapped.onnx", "evidence_dir": "disagree"}, journal="journal.sqlite")
    live, candidate = sha256(tmp_path / "scene.onnx"), sha256(tmp_path / "swapped.onnx")
    try:
        report = trial(d).candidate
        assert report is not None and report.agreement == 0.0
        assert report.classes["scratch"].live_only > 0 and report.classes["crack"].candidate_only > 0
        assert report.classes["dust"].live_only == 0 and report.gate is not None and "agree" in report.gate
        saved = tmp_path / "disagree" / "cam0"
        assert wait_for(lambda: any(saved.glob("*/messages/*.json")), 10), d.log()
        record = json.loads(next(saved.glob("*/messages/*.json")).read_text())
        assert record["candidate"]["model"]["sha256"] == candidate and record["live"]["verdict"] == "none"
        assert [box["class_id"] for box in record["live"]["detections"]] == [0, 1, 2]
        assert [box["class_id"] for box in record["candidate"]["detections"]] == [1, 0, 2]
        assert any(saved.glob("*/images/*.jpg")) and any(saved.glob("*/labels/*.txt"))

        refused = run_cli("promote", "--config", str(config))
        assert refused.returncode == 1 and "promotion refused: the models agree on 0.0%" in refused.stderr
        assert f"live: scene sha256 {live}" in refused.stderr
        no_reason = run_cli("promote", "--config", str(config), "--force")
        assert no_reason.returncode == 2 and "--force needs --reason" in no_reason.stderr  # before it is sent

        claims = {"LOGNAME": "mallory", "USER": "mallory"}  # what the client sends: its environment's word
        forced = run_cli("promote", "--config", str(config), "--force", "--reason", "new fixture", env=claims)
        assert forced.returncode == 0, forced.stderr
        assert candidate in forced.stdout and f"previous, kept for edged rollback: scene sha256 {live}" in forced.stdout
        for msg in detections_from(d, candidate):
            assert msg.model.sha256 == candidate and [x.label for x in msg.detections] == ["crack", "scratch", "dust"]
        assert "by force" in d.log() and "new fixture" in d.log()

        back = run_cli("rollback", "--config", str(config))
        assert back.returncode == 0, back.stderr
        assert f"live: scene sha256 {live}" in back.stdout
        for msg in detections_from(d, live):
            assert msg.model.sha256 == live and [x.label for x in msg.detections] == ["scratch", "crack", "dust"]
        again = run_cli("rollback", "--config", str(config))
        assert again.returncode == 1 and "nothing to roll back" in again.stderr
        status = d.wait_status(lambda s: s.candidate is not None and s.candidate.state == "on_trial")
        assert status.model.sha256 == live

        def changes() -> list[tuple[str, str, dict[str, Any]]]:
            with sqlite3.connect(tmp_path / "journal.sqlite") as db:
                query = "SELECT kind, model_sha256, message FROM entries WHERE kind IN ('promotion', 'rollback') ORDER BY id"
                return [(kind, sha, json.loads(message)) for kind, sha, message in db.execute(query)]

        assert wait_for(lambda: len(changes()) == 2, 10), changes()
        (promoted, to, said), (rolled, back_to, undone) = changes()
        assert (promoted, to, said["from_sha256"], said["to_sha256"]) == ("promotion", candidate, live, candidate)
        assert said["forced"] is True and said["reason"] == "new fixture" and "agree" in said["gate"]
        assert (said["user"], said["claimed"]) == (pwd.getpwuid(os.getuid()).pw_name, "mallory")
        assert f"by {said['user']} pid {said['pid']}, claimed 'mallory': new fixture" in d.log()
        assert (rolled, back_to, undone["from_sha256"], undone["to_sha256"]) == ("rollback", live, candidate, live)
    finally:
        d.stop()


def test_a_reload_after_a_promotion_serves_the_configured_model_and_tries_the_candidate_again(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "swapped.onnx", SWAPPED)
    d, config = start(tmp_path, {"path": "swapped.onnx"})
    live, candidate = sha256(tmp_path / "scene.onnx"), sha256(tmp_path / "swapped.onnx")
    try:
        trial(d, 1)
        forced = run_cli("promote", "--config", str(config), "--force", "--reason", "try it")
        assert forced.returncode == 0, forced.stderr
        detections_from(d, candidate, 1)
        d.signal(signal.SIGHUP)
        for msg in detections_from(d, live):
            assert msg.model.sha256 == live
        status = d.wait_status(lambda s: s.candidate is not None and s.candidate.state == "on_trial")
        assert status.candidate is not None and status.candidate.model is not None
        assert status.candidate.model.sha256 == candidate
    finally:
        d.stop()


def test_a_candidate_on_a_stalled_disk_holds_back_no_live_frame_and_no_command_swaps_meanwhile(tmp_path: Path) -> None:
    """A reload's candidate loads with its model, off the loop's thread: the live model goes on publishing
    while its file cannot be read, a promotion then is refused, and the candidate is on trial once loaded."""
    fixed_scene(tmp_path / "same.onnx", SCENE)
    d, config = start(tmp_path, {"path": "same.onnx"})
    try:
        trial(d, 1)
        slow = fixed_scene(tmp_path / "slow.onnx", SWAPPED)
        config.write_text(config.read_text().replace('path = "same.onnx"', 'path = "slow.onnx"'))
        live, candidate = sha256(tmp_path / "scene.onnx"), sha256(slow)
        with opening_stalled(slow) as waiting:
            d.signal(signal.SIGHUP)
            assert wait_for(waiting, timeout_s=20), d.log()
            assert {m.model.sha256 for m in d.captured_after(time.time_ns(), 5)} == {live}
            forced = run_cli("promote", "--config", str(config), "--force", "--reason", "now")
            assert forced.returncode == 1 and "promotion refused: a reload is loading" in forced.stderr, forced.stderr

        def tried(status: StatusMessage) -> bool:
            report = status.candidate
            return report is not None and report.model is not None and report.model.sha256 == candidate

        on_trial = d.wait_status(lambda s: tried(s) and s.candidate is not None and s.candidate.frames > 0)
        assert on_trial.candidate is not None and on_trial.candidate.state == "on_trial"
    finally:
        d.stop()


def test_in_request_mode_the_candidate_runs_between_requests(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "same.onnx", SCENE)
    trigger = f"tcp://127.0.0.1:{free_port()}"
    d, _ = start(tmp_path, {"path": "same.onnx"}, trigger={"mode": "request", "endpoint": trigger})
    try:
        for part in ("a", "b", "c"):
            asked = run_cli("trigger", trigger, "--part-id", part, "--timeout", "20")
            assert asked.returncode == 3, asked.stdout + asked.stderr  # NG: without [inspect], any detection
        report = trial(d, 2).candidate
        assert report is not None and report.agreement == 1.0 and report.failed_frames == 0
        assert set(report.verdicts) == {"ng/ng"}
    finally:
        d.stop()


def test_an_unsigned_candidate_is_refused_when_signatures_are_required(tmp_path: Path) -> None:
    private, public = keypair(tmp_path)
    fixed_scene(tmp_path / "scene.onnx", SCENE)
    assert run_cli("sign", str(tmp_path / "scene.onnx"), "--key", str(private)).returncode == 0
    fixed_scene(tmp_path / "unsigned.onnx", SWAPPED)
    signing = {"require_signature": True, "signature_key": public.name}
    d, config = start(tmp_path, {"path": "unsigned.onnx"}, signing)
    try:
        status = d.wait_status(lambda s: s.candidate is not None)
        assert status.candidate is not None and status.candidate.state == "failed"
        assert status.candidate.model is None and "signature" in (status.candidate.error or "")
        assert status.frames_processed > 0 or d.collect("detections", 2)
        refused = run_cli("promote", "--config", str(config), "--force", "--reason", "try")
        assert refused.returncode == 1 and "no candidate on trial" in refused.stderr
    finally:
        d.stop()


def test_a_candidate_that_does_not_load_is_reported_and_the_live_model_serves_on(tmp_path: Path) -> None:
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    d, _ = start(tmp_path, {"path": "broken.onnx"})
    try:
        status = d.wait_status(lambda s: s.candidate is not None and s.frames_processed > 3)
        assert status.candidate is not None and status.candidate.state == "failed"
        assert "did not load" in (status.candidate.error or "")
        assert all(m.model.sha256 == sha256(tmp_path / "scene.onnx") for m in d.collect("detections", 3))  # type: ignore[union-attr]
    finally:
        d.stop()


def test_a_candidate_that_outputs_nan_is_reported_and_the_live_path_is_untouched(tmp_path: Path) -> None:
    nan_probe(tmp_path / "nan.onnx")
    (tmp_path / "nan.labels").write_text("scratch\ncrack\n")  # the live model's first classes: comparable
    d, _ = start(tmp_path, {"path": "nan.onnx", "labels": "nan.labels"}, colour=(230, 230, 230))
    try:
        status = d.wait_status(lambda s: s.candidate is not None and s.candidate.failed_frames >= 3, timeout=30)
        assert status.candidate is not None and status.candidate.state == "on_trial"
        assert "nonfinite_output" in (status.candidate.error or "") and status.candidate.frames == 0
        assert status.drops.get("nonfinite_output", 0) == 0
        for msg in d.collect("detections", 3):
            assert isinstance(msg, DetectionsMessage) and [x.label for x in msg.detections] == ["scratch", "crack", "dust"]
    finally:
        d.stop()


def test_promote_without_a_candidate_in_the_config_says_so(tmp_path: Path) -> None:
    config = write_config(tmp_path / "edged.toml", {"model": {"path": "scene.onnx"}})
    shutil.copy(fixed_scene(tmp_path / "x.onnx", SCENE), tmp_path / "scene.onnx")
    done = run_cli("promote", "--config", str(config))
    assert done.returncode == 2 and "no [model.candidate]" in done.stderr


def cpu_s(pid: int) -> float:
    """The CPU time the main thread of process ``pid`` has used, user and system, in seconds."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_command_after_a_reload_removed_the_candidate_is_refused_and_the_loop_keeps_waiting(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "same.onnx", SCENE)
    d, config = start(tmp_path, {"path": "same.onnx"})
    started = shutil.copy(config, tmp_path / "started.toml")  # what `edged promote` reads the socket from
    try:
        d.wait_status(lambda s: s.candidate is not None)
        config.write_text(re.sub(r"\[model\.candidate\]\n(?:[^\[].*\n)*", "", config.read_text()))
        d.signal(signal.SIGHUP)
        d.wait_status(lambda s: s.candidate is None)
        promote = run_cli("promote", "--config", str(started))
        assert promote.returncode == 1, promote.stderr
        assert "refused: no [model.candidate] in the running configuration" in promote.stderr
        assert f"live: scene sha256 {sha256(tmp_path / 'scene.onnx')}" in promote.stderr
        # A client still waiting: its request, left unread, would keep the loop's wait returning at
        # once, a core's worth of turns. The loop's thread is measured over ten status messages (3 s),
        # so that a busy machine's stalls even out.
        context = zmq.Context()
        waiting = context.socket(zmq.REQ)
        waiting.setsockopt(zmq.LINGER, 0)
        try:
            waiting.connect(f"ipc://{tmp_path}/control.sock")
            waiting.send(json.dumps({"command": "rollback"}).encode())
            before, since = cpu_s(d.proc.pid), time.monotonic()
            d.collect("status", 10)
            busy = (cpu_s(d.proc.pid) - before) / (time.monotonic() - since)
            assert busy < 0.5, f"the loop's thread used {busy:.2f} CPU-seconds a second"
            assert waiting.poll(10_000), "no answer to the waiting client"
            assert json.loads(waiting.recv())["error"].startswith("refused: no [model.candidate]")
        finally:
            waiting.close()
            context.term()
    finally:
        d.stop()


def test_a_control_socket_that_cannot_be_bound_stops_the_start_with_its_error_alone(tmp_path: Path) -> None:
    unwritable, _ = configure(tmp_path, {"path": "scene.onnx", "control": "ipc:///proc/sys/edged-control.sock"})
    refused = run_cli("run", "--config", str(unwritable))
    assert refused.returncode == 1, refused.stderr
    assert "model.candidate.control: cannot bind ipc:///proc/sys/edged-control.sock" in refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr

    d, config = start(tmp_path, {"path": "scene.onnx"})
    try:
        d.wait_status(lambda s: s.candidate is not None)
        second = tmp_path / "second.toml"  # the same control socket, its own publish port
        second.write_text(config.read_text().replace(d.endpoint, f"tcp://127.0.0.1:{free_port()}"))
        refused = run_cli("run", "--config", str(second))
        assert refused.returncode == 1, refused.stderr
        assert "another process is listening on" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    finally:
        d.stop()


def test_a_control_path_taken_by_a_file_a_link_or_a_folder_or_too_long_is_refused_and_left_alone(
    tmp_path: Path,
) -> None:
    # libzmq's bind deletes whatever is at an ipc path: `edged check` and `edged run` replaced a
    # mistyped control path's file (the configuration itself, say) with their socket.
    (tmp_path / "edged.conf.bak").write_text("precious\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "link.sock").symlink_to(tmp_path / "edged.conf.bak")
    long = tmp_path / ("x" * 110)
    cases = {
        "edged.conf.bak": "is a file, not a socket, which edged would replace",
        "folder": "is a folder, not a socket",
        "link.sock": "is a link, not a socket",
        long.name: f"the path is {len(str(long))} bytes and a socket's holds at most 107",
    }
    for name, why in cases.items():
        control = f"ipc://{tmp_path / name}"
        config, _ = configure(tmp_path, {"path": "scene.onnx", "control": control})
        for command in ("check", "run"):
            refused = run_cli(command, "--config", str(config))
            assert refused.returncode == 78, refused.stderr
            assert f"model.candidate.control: {control}: " in refused.stderr and why in refused.stderr, refused.stderr
    assert (tmp_path / "edged.conf.bak").read_text() == "precious\n" and (tmp_path / "folder").is_dir()
    assert (tmp_path / "link.sock").is_symlink() and not long.exists()
    abstract, _ = configure(tmp_path, {"path": "scene.onnx", "control": "ipc://@edged-control"})
    refused = run_cli("check", "--config", str(abstract))
    assert refused.returncode == 78 and "not an abstract name (@)" in refused.stderr, refused.stderr


def test_a_flood_of_commands_holds_up_neither_the_frames_nor_the_stop(tmp_path: Path) -> None:
    # Clients in the service's group that send commands as fast as libzmq takes them and read no
    # answer: the loop answers a few a turn, so frames and status go on and SIGTERM stops it.
    d, _ = start(tmp_path, {"path": "scene.onnx"})
    context = zmq.Context()
    try:
        d.wait_status(lambda s: s.candidate is not None)
        with Flood(context, f"ipc://{tmp_path}/control.sock", json.dumps({"command": "rollback"}).encode()) as flood:
            assert wait_for(lambda: flood.sent >= 50_000, 60), flood.sent
            since_ns = time.time_ns()
            d.captured_after(since_ns, 3, timeout=30)  # live frames go on amid the flood
            d.signal(signal.SIGTERM)
            assert d.proc.wait(30) == 0, d.log()
    finally:
        context.term()
        d.stop()


def test_a_reason_in_any_script_reaches_the_daemon_whole_and_one_too_long_is_refused_before_sending(
    tmp_path: Path,
) -> None:
    # Sent as ASCII JSON, each Japanese character took 6 bytes: these 241 passed the 300-character
    # cap, and the daemon dropped the request over its 1 KiB limit, "no answer ... is edged running?".
    d, config = start(tmp_path, {"path": "scene.onnx", "min_frames": 100_000})  # promoted by force only
    reason = "新しい治具で旧モデルは合わない" * 16 + "。"
    try:
        d.wait_status(lambda s: s.candidate is not None)
        forced = run_cli("promote", "--config", str(config), "--force", "--reason", reason, "--timeout", "10")
        assert forced.returncode == 0, forced.stderr
        assert wait_for(lambda: f": {reason}; gate:" in d.log(), 10), d.log()
        d.signal(signal.SIGHUP)  # the candidate back on trial
        d.wait_status(lambda s: s.candidate is not None and s.candidate.state == "on_trial")
        too_long = run_cli("promote", "--config", str(config), "--force", "--reason", "x" * 301)
        assert too_long.returncode == 2, too_long.stderr
        assert "--reason is 301 characters (301 bytes in UTF-8): a request carries at most 300" in too_long.stderr
        assert d.log().count("promoted model") == 1
    finally:
        d.stop()


AZURE, CPU = "AzureExecutionProvider", "CPUExecutionProvider"


def on_two_providers(tmp_path: Path) -> tuple[RunningDaemon, Path]:
    """A live model and a candidate, both failing on bright frames, on two providers (Azure takes no
    node: CPU runs them), serving a folder of dark images, and its configuration."""
    failing_probe(tmp_path / "live.onnx")
    failing_probe(tmp_path / "candidate.onnx", brighter_than=0.6)  # another file, alike on dark frames
    (tmp_path / "imgs").mkdir()
    for i in range(10):
        cv2.imwrite(str(tmp_path / "imgs" / f"a{i:02d}.png"), np.zeros((128, 128, 3), np.uint8))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc: dict[str, dict[str, Any]] = {
        "source": {"type": "images", "path": "imgs", "fps": 20.0},
        "model": {"path": "live.onnx"},
        "model.candidate": {
            "path": "candidate.onnx",
            "sample_every": 1,
            "min_frames": 5,
            "control": f"ipc://{tmp_path}/c.sock",
        },
        "runtime": {"providers": [{"name": AZURE}, {"name": CPU}]},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.3},
        "thermal": {"enabled": False},
    }
    config = write_config(tmp_path / "edged.toml", doc)
    return RunningDaemon(config, endpoint), config


def fall_back(d: RunningDaemon, tmp_path: Path, serving: Path) -> None:
    """Inference failing on 20 frames in a row (bright ones, moved in for a while), on the first provider
    of ``serving``, the live model's file: the fallback loads it again, then the bright frames go."""
    (tmp_path / "bright").mkdir()
    bright = [tmp_path / "bright" / f"b{i:02d}.png" for i in range(25)]
    for image in bright:
        cv2.imwrite(str(image), np.full((128, 128, 3), 255, np.uint8))
    with opening_stalled(serving) as waiting:  # the fallback waits for the bright frames to go
        for image in bright:  # each moved in whole: none read half written
            image.rename(tmp_path / "imgs" / image.name)
        assert wait_for(waiting, timeout_s=20), d.log()
        for image in bright:
            (tmp_path / "imgs" / image.name).rename(image)
    d.wait_status(lambda s: s.model.provider == CPU)


def candidate_on(status: StatusMessage, provider: str, frames: int = 0) -> bool:
    report = status.candidate
    return report is not None and report.model is not None and report.model.provider == provider and report.frames >= frames


def test_a_fallback_moves_the_candidate_on_trial_to_the_providers_left_where_it_passes_its_gate(tmp_path: Path) -> None:
    """The candidate stayed on the provider a fallback dropped: its frames failed there, so that it
    could not pass the gate however good it was, and promoted by force it brought the failing provider back."""
    d, config = on_two_providers(tmp_path)
    candidate = sha256(tmp_path / "candidate.onnx")
    try:
        d.wait_status(lambda s: candidate_on(s, AZURE, 1))
        fall_back(d, tmp_path, tmp_path / "live.onnx")
        status = d.wait_status(lambda s: candidate_on(s, CPU, 5) and s.candidate is not None and s.candidate.gate is None)
        assert status.candidate is not None and status.candidate.state == "on_trial"
        assert status.candidate.failed_frames == 0 and status.candidate.agreement == 1.0
        assert "the candidate follows the live model onto CPUExecutionProvider: its trial starts again" in d.log()
        promoted = run_cli("promote", "--config", str(config))
        assert promoted.returncode == 0, promoted.stderr
        assert {msg.model.provider for msg in detections_from(d, candidate)} == {CPU}
        assert d.log().count("falling back to") == 1 and d.proc.poll() is None
    finally:
        d.stop()


def test_a_rollback_after_a_fallback_brings_back_the_replaced_model_on_the_providers_left(tmp_path: Path) -> None:
    """The model a promotion replaced stayed on the provider a fallback dropped: a rollback brought it
    back there, to fail 20 frames and fall back again."""
    d, config = on_two_providers(tmp_path)
    live, candidate = sha256(tmp_path / "live.onnx"), sha256(tmp_path / "candidate.onnx")
    try:
        d.wait_status(lambda s: candidate_on(s, AZURE, 1))
        forced = run_cli("promote", "--config", str(config), "--force", "--reason", "v2")
        assert forced.returncode == 0, forced.stderr
        assert {msg.model.provider for msg in detections_from(d, candidate)} == {AZURE}
        fall_back(d, tmp_path, tmp_path / "candidate.onnx")  # the candidate, live, falls back
        assert d.wait_status(lambda s: candidate_on(s, CPU)).model.sha256 == candidate  # kept for rollback: on CPU
        assert "the model kept for rollback follows the live model onto CPUExecutionProvider" in d.log()
        back = run_cli("rollback", "--config", str(config))
        assert back.returncode == 0, back.stderr
        assert {msg.model.provider for msg in detections_from(d, live)} == {CPU}
        status = d.wait_status(
            lambda s: s.candidate is not None and s.candidate.state == "on_trial" and candidate_on(s, CPU)
        )
        assert status.candidate is not None and status.candidate.model is not None
        assert status.candidate.model.sha256 == candidate  # back on trial, on the providers left too
        assert d.log().count("falling back to") == 1 and d.proc.poll() is None
    finally:
        d.stop()
