"""Request mode on the running daemon: one inspection per request over a real REQ socket, and ``edged trigger``."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import zmq
from daemon import RunningDaemon, free_port, run_cli, write_config
from floods import Flood
from onnx_models import failing_probe, fixed_scene
from waiting import wait_for

from edged.keys import create_key_pair
from edged.messages import AnyMessage, DetectionsMessage, StatusMessage, TriggerError, VerdictMessage, parse_message

pytestmark = pytest.mark.integration

SCENE = [(16.0, 20.0, 8.0, 8.0, 0, 0.9), (48.0, 44.0, 8.0, 8.0, 1, 0.5)]  # scratch top-left, crack bottom-right
THERMAL = Path(__file__).parent / "fixtures" / "thermal" / "rpi4"


def images(folder: Path, grey: int = 90, count: int = 3) -> Path:
    folder.mkdir()
    for i in range(count):
        cv2.imwrite(str(folder / f"{i}.png"), np.full((96, 128, 3), grey, np.uint8))
    return folder


@contextmanager
def running(
    tmp_path: Path,
    *,
    fps: float = 2.0,
    model: str = "scene",
    ipc: bool = False,
    env: dict[str, str] | None = None,
    **sections: dict[str, Any],
) -> Iterator[RunningDaemon]:
    """The daemon in request mode on an images folder at ``fps``; its trigger endpoint in ``d.trigger``.

    ``ipc`` publishes on an ipc:// socket, which stays plain when CURVE keys are configured;
    ``env`` is added to the daemon's environment.
    """
    if model == "scene":
        fixed_scene(tmp_path / "model.onnx", SCENE)
    else:
        failing_probe(tmp_path / "model.onnx")
    folder = tmp_path / "frames"
    if not folder.exists():
        images(folder)
    endpoint, trigger = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    if ipc:
        endpoint = f"ipc://{tmp_path / 'stream.sock'}"
    doc: dict[str, dict[str, Any]] = {
        "source": sections.pop("source", {"type": "images", "path": str(folder), "fps": fps}),
        "model": {"path": "model.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.25},
        "thermal": {"enabled": False},
        "trigger": {"mode": "request", "endpoint": trigger, "timeout_s": 2.0},
    }
    for name, keys in sections.items():
        doc.setdefault(name, {}).update(keys)
    d = RunningDaemon(write_config(tmp_path / "edged.toml", doc), endpoint, env)
    d.trigger = doc["trigger"]["endpoint"]  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        d.close()


class Requester:
    """REQ sockets of this process on the daemon's trigger endpoint."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.context = zmq.Context()

    def send(self, payload: bytes) -> zmq.Socket[bytes]:
        sock = self.context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        sock.send(payload)
        return sock

    @staticmethod
    def reply(sock: zmq.Socket[bytes], timeout_s: float = 15) -> AnyMessage:
        try:
            assert sock.poll(int(timeout_s * 1000)), "no reply"
            return parse_message(sock.recv())
        finally:
            sock.close(linger=0)

    def ask(self, payload: bytes, timeout_s: float = 15) -> AnyMessage:
        return self.reply(self.send(payload), timeout_s)

    def close(self) -> None:
        self.context.destroy(linger=0)


def ready(d: RunningDaemon, frames: int = 1) -> StatusMessage:
    """The daemon is up with at least ``frames`` captured (a status message says so)."""
    return d.wait_status(lambda s: s.capture is not None and s.capture.frames_captured >= frames, timeout=30)


def test_each_request_inspects_a_frame_captured_after_it_arrived(tmp_path: Path) -> None:
    # At 2 fps a frame captured up to half a second before the request always waits in the
    # latest-frame slot (the loop does not take frames between requests): taking it would
    # give a capture time before the request was sent.
    with running(tmp_path) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            status = ready(d, frames=3)
            for i in range(4):
                sent_ns = time.time_ns()
                reply = ask.ask(f'{{"part_id": "P{i}"}}'.encode())
                assert isinstance(reply, VerdictMessage), reply
                assert reply.capture_time_ns > sent_ns, (reply, sent_ns)
                assert status.capture is not None and reply.frame_id >= status.capture.frames_captured
                assert reply.part_id == f"P{i}" and reply.verdict == "ng" and reply.verdict_latency_ms > 0
                status = d.wait_status(lambda s: True)  # the next request lands elsewhere in the frame cycle
        finally:
            ask.close()


def test_a_request_publishes_its_detections_and_verdict_and_nothing_flows_without_one(tmp_path: Path) -> None:
    with running(tmp_path, inspect={"ng_classes": ["crack"], "zones": {"top": [[0, 0], [1, 0], [1, 0.5], [0, 0.5]]}}) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            ready(d, frames=3)
            assert [m.kind for m in d.messages(1.5) if m.kind != "status"] == []  # no free-running frames
            reply = ask.ask(b'{"part_id": "A-1"}')
            assert isinstance(reply, VerdictMessage) and reply.verdict == "ok" and reply.reasons == []
            published: dict[str, Any] = {}
            for msg in d.messages(10):
                published.setdefault(msg.kind, msg)
                if {"detections", "verdict"} <= set(published):
                    break
            detections, verdict = published["detections"], published["verdict"]
            assert isinstance(detections, DetectionsMessage) and verdict == reply
            assert detections.frame_id == reply.frame_id and detections.part_id == "A-1"
            assert [(x.label, x.zone) for x in detections.detections] == [("scratch", "top")]  # the crack is outside
        finally:
            ask.close()


def test_no_frame_in_time_is_a_timeout_reply_and_beyond_the_queue_busy(tmp_path: Path) -> None:
    # One image every 20 s: after the first, no frame comes within any request's 3 s. The three
    # requests go down one DEALER connection back to back, so they arrive together, long before
    # the first times out, and the third finds the queue full however busy the machine is.
    with running(tmp_path, fps=0.05, trigger={"timeout_s": 3.0, "queue": 1}) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        dealer = ask.context.socket(zmq.DEALER)
        try:
            ready(d)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(d.trigger)  # type: ignore[attr-defined]
            for part in "ABC":
                dealer.send_multipart([b"", f'{{"part_id": "{part}"}}'.encode()])
            started = time.monotonic()
            replies = []
            for _ in range(3):
                assert dealer.poll(30_000), f"no reply; have {replies}"
                reply = parse_message(dealer.recv_multipart()[-1])
                assert isinstance(reply, TriggerError), reply
                replies.append((reply.part_id, reply.error, reply.detail))
            assert replies[0][:2] == ("C", "busy"), replies  # at once, before either times out
            assert [r[:2] for r in replies[1:]] == [("A", "timeout"), ("B", "timeout")], replies
            assert all("no frame captured after the request within 3 s" in r[2] for r in replies[1:])
            assert time.monotonic() - started < 15
            bad = ask.ask(b"not json")
            assert isinstance(bad, TriggerError) and bad.error == "bad_request" and "JSON" in bad.detail
        finally:
            dealer.close(linger=0)
            ask.close()


def test_a_lost_camera_and_a_failing_model_are_error_replies_saying_why(tmp_path: Path) -> None:
    lost = tmp_path / "lost"
    lost.mkdir()
    with running(lost, source={"type": "v4l2", "device": "/dev/video99"}) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            d.wait_status(lambda s: s.source_state == "lost")
            reply = ask.ask(b"{}")
            assert isinstance(reply, TriggerError) and reply.error == "camera_lost" and reply.part_id is None
            assert "/dev/video99" in reply.detail
        finally:
            ask.close()
    failing = tmp_path / "failing"
    failing.mkdir()
    images(failing / "frames", grey=255)  # bright frames make the probe raise inside ONNX Runtime
    with running(failing, model="failing") as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            ready(d)
            reply = ask.ask(b'{"part_id": "X"}')
            assert isinstance(reply, TriggerError) and reply.error == "inference_failed", reply
        finally:
            ask.close()


def test_thermal_critical_is_an_error_reply(tmp_path: Path) -> None:
    root = tmp_path / "board"
    shutil.copytree(THERMAL, root)
    (root / "sys/class/thermal/thermal_zone0/temp").write_text("90000\n")
    thermal = {"enabled": True, "root": str(root), "poll_interval_s": 0.2, "use_vcgencmd": False}
    with running(tmp_path, thermal=thermal) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            d.wait_status(lambda s: s.thermal is not None and s.thermal.state == "critical")
            reply = ask.ask(b"{}")
            assert isinstance(reply, TriggerError) and reply.error == "thermal_critical", reply
        finally:
            ask.close()


def test_edged_trigger_prints_the_verdict_and_exits_by_it(tmp_path: Path) -> None:
    ok_zone = {"zones": {"corner": [[0.9, 0.9], [1, 0.9], [1, 1]]}}
    for inspect, code, shown in (({}, 3, "NG: scratch 0.90; crack 0.50"), (ok_zone, 0, "OK")):
        folder = tmp_path / f"exit{code}"
        folder.mkdir()
        with running(folder, inspect=inspect) as d:
            ready(d)
            result = run_cli("trigger", d.trigger, "--part-id", "B-7", "--timeout", "10")  # type: ignore[attr-defined]
            assert result.returncode == code, result.stderr
            assert "part B-7]" in result.stdout and shown in result.stdout
            as_json = run_cli("trigger", d.trigger, "--json", "--timeout", "10")  # type: ignore[attr-defined]
            assert as_json.returncode == code and VerdictMessage.model_validate_json(as_json.stdout).part_id is None
    nobody = run_cli("trigger", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert nobody.returncode == 1 and "no reply from" in nobody.stderr


def test_sigterm_answers_the_request_in_hand_and_those_waiting_that_edged_is_stopping(tmp_path: Path) -> None:
    with running(tmp_path, fps=0.05, trigger={"timeout_s": 30.0}) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            ready(d)
            first, second = ask.send(b'{"part_id": "A"}'), ask.send(b'{"part_id": "B"}')
            d.wait_status(lambda s: True)  # the requests are on their way while the loop turns
            d.signal(signal.SIGTERM)
            for sock, part in ((first, "A"), (second, "B")):
                reply = ask.reply(sock, timeout_s=10)
                assert isinstance(reply, TriggerError) and (reply.error, reply.part_id) == ("stopping", part), reply
            assert d.proc.wait(20) == 0  # the one SIGTERM stops it: a second, while it exits, would kill it
        finally:
            ask.close()


def test_a_tcp_trigger_takes_the_publishers_curve_keys_and_refuses_other_clients(tmp_path: Path) -> None:
    server_public, server_secret = create_key_pair(tmp_path / "server", "server")
    client_public, client_secret = create_key_pair(tmp_path / "gateway", "gateway")
    _, outsider_secret = create_key_pair(tmp_path / "elsewhere", "outsider")
    clients = tmp_path / "clients"
    clients.mkdir()
    shutil.copy(client_public, clients)
    trigger = f"tcp://0.0.0.0:{free_port()}"  # on the network: acceptable only with CURVE
    curve = {"curve_server_key": str(server_secret), "curve_clients_dir": str(clients)}
    with running(tmp_path, ipc=True, publish=curve, trigger={"endpoint": trigger}) as d:
        ready(d)
        endpoint = trigger.replace("0.0.0.0", "127.0.0.1")
        keys = ("--server-key", str(server_public), "--client-key", str(client_secret))
        allowed = run_cli("trigger", endpoint, "--part-id", "K-1", "--timeout", "10", *keys)
        assert allowed.returncode == 3 and "part K-1]" in allowed.stdout, allowed.stderr
        outsider = ("--server-key", str(server_public), "--client-key", str(outsider_secret))
        for refused in (outsider, ()):
            result = run_cli("trigger", endpoint, "--timeout", "2", *refused)
            assert result.returncode == 1 and "no reply from" in result.stderr, result


def test_a_trigger_endpoint_on_the_network_without_keys_is_refused_by_check_and_run_unless_trigger_insecure(
    tmp_path: Path,
) -> None:
    # Refused as a configuration (78, which systemd does not restart), naming the trigger endpoint;
    # publish.insecure opens the stream only, never the request socket.
    trigger = f"tcp://0.0.0.0:{free_port()}"
    refused = tmp_path / "refused"
    refused.mkdir()
    with running(refused, trigger={"endpoint": trigger}, publish={"insecure": True}) as d:
        assert d.proc.wait(60) == 78, d.log()
        run_log = d.log()
    check = run_cli("check", "--config", str(refused / "edged.toml"))
    for command, code, out in (("run", 78, run_log), ("check", check.returncode, check.stderr)):
        assert code == 78, (command, out)
        assert f"trigger.endpoint '{trigger}' is not a loopback address" in out, (command, out)
        assert "set trigger.insecure = true" in out and "publish.insecure" not in out, (command, out)
    opted_in = tmp_path / "opted-in"
    opted_in.mkdir()
    with running(opted_in, trigger={"endpoint": trigger, "insecure": True}) as d:
        ready(d)
        asked = run_cli("trigger", trigger.replace("0.0.0.0", "127.0.0.1"), "--part-id", "P-2", "--timeout", "10")
        assert asked.returncode == 3 and "part P-2]" in asked.stdout, asked.stderr
        assert d.stop() == 0


def test_an_ipc_trigger_endpoint_outside_the_runtime_directory_is_refused_and_its_folder_not_made(
    tmp_path: Path,
) -> None:
    runtime = tmp_path / "run"
    env = {"RUNTIME_DIRECTORY": str(runtime)}
    missing = tmp_path / "nonexistent" / "dir"
    trigger = f"ipc://{missing}/trigger.sock"
    with running(tmp_path, env=env, trigger={"endpoint": trigger}) as d:
        assert d.proc.wait(60) == 78, d.log()
        run_log = d.log()
    check = run_cli("check", "--config", str(tmp_path / "edged.toml"), env=env)
    problem = f"trigger.endpoint: {trigger}: the folder {missing} does not exist, and edged makes folders only"
    for command, code, out in (("run", 78, run_log), ("check", check.returncode, check.stderr)):
        assert code == 78 and problem in out and str(runtime) in out, (command, out)
    assert not (tmp_path / "nonexistent").exists()
    trigger = f"ipc://{runtime}/line3/trigger.sock"
    with running(tmp_path, env=env, trigger={"endpoint": trigger}) as d:
        ready(d)
        asked = run_cli("trigger", trigger, "--part-id", "P-3", "--timeout", "10")
        assert asked.returncode == 3 and "part P-3]" in asked.stdout, asked.stderr
        assert d.stop() == 0


def test_a_reloads_trial_frame_is_not_published_in_request_mode(tmp_path: Path) -> None:
    # A reload runs its model on a frame before it takes over. In request mode nobody asked for
    # that frame: neither a refused reload nor one that takes over publishes it.
    with running(tmp_path) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            before = ready(d, frames=3)
            config = tmp_path / "edged.toml"
            written = config.read_text()
            failing_probe(tmp_path / "failing.onnx", brighter_than=0.1)  # loads, fails on the grey frames
            fixed_scene(tmp_path / "other.onnx", [(48.0, 44.0, 8.0, 8.0, 1, 0.7)])  # a crack only
            for model in ("failing.onnx", "other.onnx"):
                config.write_text(written.replace('"model.onnx"', f'"{model}"'))
                d.signal(signal.SIGHUP)
                refused_seen_ns = None
                for msg in d.messages(30):
                    assert isinstance(msg, StatusMessage), msg  # no detections, no verdict
                    if model == "other.onnx" and msg.model.sha256 != before.model.sha256:
                        break  # taken over: the trial frame went through before this status
                    if refused_seen_ns is not None and msg.time_ns > refused_seen_ns:
                        break  # a status made after the refusal and whatever followed it
                    if model == "failing.onnx" and refused_seen_ns is None and "reload refused" in d.log():
                        refused_seen_ns = time.time_ns()
                else:
                    raise AssertionError(f"the reload to {model} was not seen:\n{d.log()}")
            reply = ask.ask(b'{"part_id": "after"}')
            assert isinstance(reply, VerdictMessage) and [r.label for r in reply.reasons] == ["crack"], reply
        finally:
            ask.close()


def test_a_reload_that_turns_request_mode_off_is_refused_and_requests_are_answered_on(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            ready(d)
            config = tmp_path / "edged.toml"
            config.write_text(config.read_text().replace("[source]\n", '[source]\ntrigger = "free"\n'))
            d.signal(signal.SIGHUP)
            refused = "the reload turns request mode on or off (no camera took requests, or none would): restart edged"
            assert wait_for(lambda: refused in d.log(), 30), d.log()
            assert d.log().count("reload refused") == 1
            reply = ask.ask(b'{"part_id": "still", "camera_id": "cam0"}')
            assert isinstance(reply, VerdictMessage) and (reply.camera_id, reply.part_id) == ("cam0", "still"), reply
        finally:
            ask.close()


def test_a_requests_part_id_names_its_evidence_and_its_journal_entry_points_at_the_picture(tmp_path: Path) -> None:
    history = ("history", "--config", str(tmp_path / "edged.toml"), "--part-id", "A-1017/rev 2", "--json")
    with running(tmp_path, inspect={"ng_classes": ["crack"]}, evidence={"dir": "evidence", "save": "all"}) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            ready(d)
            reply = ask.ask(b'{"part_id": "A-1017/rev 2"}')
            assert isinstance(reply, VerdictMessage) and reply.part_id == "A-1017/rev 2"
            # read from another process while edged runs
            assert wait_for(lambda: len(json.loads(run_cli(*history).stdout)) == 1, 10)
        finally:
            ask.close()
    [row] = json.loads(run_cli(*history).stdout)
    image = Path(row["evidence"])
    assert image.name.endswith("_A-1017_rev_2.jpg") and image.parent.name == "images"  # no folder from the "/"
    assert wait_for(image.is_file, 10) and image.parent.parent.parent.name == "cam0"
    assert row["message"]["frame_id"] == reply.frame_id and row["part_id"] == "A-1017/rev 2"


def test_a_flood_of_requests_holds_up_neither_the_loop_nor_its_stop(tmp_path: Path) -> None:
    # Clients that send requests as fast as libzmq takes them and read no reply: the loop reads a
    # bounded batch a turn, so status and requests go on and SIGTERM stops it while the flood goes on.
    with running(tmp_path, fps=5.0) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        try:
            ready(d)
            with Flood(ask.context, ask.endpoint, b'{"part_id": "flood"}') as flood:
                assert wait_for(lambda: flood.sent >= 50_000, 60), flood.sent
                since_ns = time.time_ns()
                d.wait_status(lambda s: s.time_ns > since_ns, timeout=30)  # the loop turns amid the flood
                reply = ask.ask(b'{"part_id": "amid"}', timeout_s=30)
                assert isinstance(reply, VerdictMessage | TriggerError) and reply.part_id == "amid", reply
                d.signal(signal.SIGTERM)
                assert d.proc.wait(30) == 0, d.log()
        finally:
            ask.close()


def test_a_trigger_endpoint_with_an_abstract_name_is_bound_and_answers(tmp_path: Path) -> None:
    # An abstract ipc name (@...) has no file: its bind ended in a traceback, chmod finding none.
    endpoint = f"ipc://@edged-trigger-{tmp_path.name}-{time.monotonic_ns()}"
    with running(tmp_path, trigger={"endpoint": endpoint}) as d:
        ask = Requester(endpoint)
        try:
            ready(d)
            reply = ask.ask(b'{"part_id": "abstract"}')
            assert isinstance(reply, VerdictMessage) and reply.part_id == "abstract", reply
        finally:
            ask.close()


def test_a_request_mode_source_that_ends_unasked_says_no_frame_was_processed(tmp_path: Path) -> None:
    # edged exits 0 at the end of a finite source; having published nothing of it, it says so.
    source = {"type": "images", "path": str(images(tmp_path / "frames")), "fps": 20.0, "loop": False}
    with running(tmp_path, source=source) as d:
        assert d.proc.wait(60) == 0, d.log()
        assert "WARNING" in d.log() and "source ended: stopping (0 frames processed); a camera that" in d.log(), d.log()
