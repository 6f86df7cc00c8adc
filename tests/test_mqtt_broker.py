"""The MQTT output against a real Mosquitto: topics and payloads, Last Will, outages, credentials, TLS, a fleet.

Every test starts Debian's ``mosquitto`` on a free loopback port with a config it writes, runs the real
daemon as a subprocess, and reads the broker with an independent client (``mosquitto_sub`` or paho),
while the ZeroMQ stream is read as well: MQTT is an output beside it, never in its way.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon import RunningDaemon, free_port, rss_kb, run_cli, write_config, write_video
from mosquitto import Broker, Listener, make_ca, make_password_file, make_server_cert
from onnx_models import colour_probe
from waiting import wait_for

from edged.messages import DetectionsMessage, StatusMessage, parse_message
from edged.settings.mqtt import topic_hostname

pytestmark = pytest.mark.integration

RED, BLUE = (0, 0, 255), (255, 0, 0)
PREFIX = "site1/line2/board3"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    colour_probe(tmp_path / "probe.onnx")
    write_video(tmp_path / "clip.avi", [RED if i % 2 == 0 else BLUE for i in range(40)])
    return tmp_path


@pytest.fixture
def broker(workdir: Path) -> Iterator[Broker]:
    b = Broker(workdir, free_port())
    yield b
    b.close()


def start(
    workdir: Path,
    port: int,
    *,
    camera: str = "cam0",
    name: str = "edged",
    realtime: bool = True,
    env: dict[str, str] | None = None,
    **mqtt: object,
) -> RunningDaemon:
    """`edged run` on the looping clip, publishing on ZeroMQ and to the broker on ``port``."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc = {
        "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": realtime, "camera_id": camera},
        "model": {"path": "probe.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
        "thermal": {"enabled": False},
        "mqtt": {"url": f"mqtt://127.0.0.1:{port}", "keepalive_s": 5, **mqtt},
    }
    return RunningDaemon(write_config(workdir / f"{name}.toml", doc), endpoint, env=env)


def detections(listener: Listener, topic: str, count: int, timeout_s: float = 30.0) -> list[DetectionsMessage]:
    msgs = [parse_message(m.payload) for m in listener.wait(topic, count, timeout_s)]
    assert all(isinstance(m, DetectionsMessage) for m in msgs)
    return [m for m in msgs if isinstance(m, DetectionsMessage)]


def state(listener: Listener, prefix: str) -> bytes | None:
    got = listener.on(f"{prefix}/state")
    return got[-1].payload if got else None


def test_detections_status_and_state_arrive_as_documented_and_the_last_will_says_offline(
    workdir: Path, broker: Broker
) -> None:
    d = start(workdir, broker.port, topic_prefix=PREFIX)
    try:
        zmq_msgs = d.collect("detections", 3)
        d.wait_status(lambda s: s.mqtt_state == "connected")
        d.collect("status", 1)  # sent once connected: what the broker retains now
        # mosquitto_sub, Debian's own client: the topic tree and the payloads as documented.
        sub = subprocess.run(
            ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-t", "site1/#", "-v", "-C", "12", "-W", "60"],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert sub.returncode == 0, sub.stderr
        lines = [line.split(" ", 1) for line in sub.stdout.splitlines()]
        by_topic: dict[str, list[str]] = {}
        for topic, payload in lines:
            by_topic.setdefault(topic, []).append(payload)
        assert by_topic[f"{PREFIX}/state"] == ["online"]  # retained, so a late subscriber sees it first
        status = parse_message(by_topic[f"{PREFIX}/cam0/status"][0].encode())  # retained too
        assert isinstance(status, StatusMessage) and status.camera_id == "cam0"
        assert status.mqtt_state == "connected" and status.mqtt_drops is not None
        frames = [parse_message(p.encode()) for p in by_topic[f"{PREFIX}/cam0/detections"]]
        assert frames and all(isinstance(m, DetectionsMessage) and m.camera_id == "cam0" for m in frames)
        assert set(by_topic) == {f"{PREFIX}/state", f"{PREFIX}/cam0/status", f"{PREFIX}/cam0/detections"}

        # The same messages as on ZeroMQ, byte for byte in content.
        listener = Listener(broker.port, f"{PREFIX}/#")
        over_mqtt = {m.seq: m for m in detections(listener, f"{PREFIX}/cam0/detections", 5)}
        over_zmq = {m.seq: m for m in d.collect("detections", 40) if isinstance(m, DetectionsMessage)}
        common = set(over_mqtt) & set(over_zmq)
        assert common and all(over_mqtt[s] == over_zmq[s] for s in common)
        assert zmq_msgs[0].seq < min(common)

        d.proc.kill()  # kill -9: no goodbye, the broker publishes the Last Will
        d.proc.wait(10)
        assert wait_for(lambda: state(listener, PREFIX) == b"offline", 20), listener.on(f"{PREFIX}/state")
        assert listener.on(f"{PREFIX}/state")[-1].retain is False  # live delivery of the retained will
        listener.close()
        late = Listener(broker.port, f"{PREFIX}/state")
        assert late.wait(f"{PREFIX}/state")[0].payload == b"offline" and late.on(f"{PREFIX}/state")[0].retain
        late.close()
    finally:
        d.close()


def test_a_password_file_authenticates_and_sigterm_says_offline_within_two_seconds(workdir: Path) -> None:
    b = Broker(workdir, free_port(), password_file=make_password_file(workdir / "passwd", "line3", "s3cret"))
    secret = workdir / "mqtt.password"
    secret.write_text("s3cret\n")
    secret.chmod(0o640)
    d = start(workdir, b.port, username="line3", password_file=str(secret))
    try:
        listener = Listener(b.port, "edged/#", username="line3", password="s3cret")
        prefix = f"edged/{topic_hostname()}"
        detections(listener, f"{prefix}/cam0/detections", 3)
        assert state(listener, prefix) == b"online"

        check = run_cli("check", "--no-bind", "--config", str(workdir / "edged.toml"))  # beside the running daemon
        assert check.returncode == 0, check.stdout + check.stderr
        assert "accepted connection as line3" in check.stdout

        started = time.monotonic()
        assert d.stop(timeout=5) == 0
        assert time.monotonic() - started < 2.0
        assert wait_for(lambda: state(listener, prefix) == b"offline", 10)
        # Said by edged itself before a clean DISCONNECT, not left to the Last Will by an output that failed.
        assert " ERROR " not in d.log_path.read_text(), d.log_path.read_text()
        listener.close()
    finally:
        d.close()
        b.close()


def test_a_wrong_password_is_logged_with_the_reason_code_retried_and_never_stops_zeromq(workdir: Path) -> None:
    b = Broker(workdir, free_port(), password_file=make_password_file(workdir / "passwd", "line3", "s3cret"))
    secret = workdir / "mqtt.password"
    secret.write_text("wrong\n")
    secret.chmod(0o600)
    d = start(workdir, b.port, username="line3", password_file=str(secret))
    try:
        first = d.collect("detections", 3)[0]
        status = d.wait_status(lambda s: s.frames_processed > 20)
        assert status.mqtt_state == "disconnected"
        assert d.collect("detections", 3)[-1].frame_id > first.frame_id  # ZeroMQ flows all along
        log = d.log()
        assert "the broker refused the connection: Not authorized (reason code 135)" in log, log
        assert "check mqtt.username and mqtt.password_file" in log
        assert wait_for(lambda: b.log().count("not authorised") >= 3, 30), b.log()  # retried, with backoff
        assert d.proc.poll() is None

        check = run_cli("check", "--no-bind", "--config", str(workdir / "edged.toml"))  # beside the running daemon
        assert check.returncode == 1, check.stdout + check.stderr
        assert "Not authorized (reason code 135)" in check.stderr
    finally:
        d.close()
        b.close()


def test_tls_with_the_right_ca_publishes_and_an_untrusted_certificate_is_reported_and_retried(workdir: Path) -> None:
    ca = make_ca(workdir, "ca")
    other_ca = make_ca(workdir, "other")
    tls = make_server_cert(workdir, ca)
    b = Broker(workdir, free_port(), tls=tls)
    good = start(workdir, b.port, url=f"mqtts://127.0.0.1:{b.port}", ca_file=str(ca[0]), name="good", camera="good")
    bad = start(workdir, b.port, url=f"mqtts://localhost:{b.port}", ca_file=str(other_ca[0]), name="bad", camera="bad")
    try:
        listener = Listener(b.port, "edged/#", ca=ca[0])
        prefix = f"edged/{topic_hostname()}"
        detections(listener, f"{prefix}/good/detections", 3)

        status = bad.wait_status(lambda s: s.frames_processed > 10)
        assert status.mqtt_state == "disconnected"
        assert "the certificate of localhost" in bad.log() and "is not trusted" in bad.log(), bad.log()
        assert not listener.on(f"{prefix}/bad/detections")
        check = run_cli("check", "--no-bind", "--config", str(workdir / "bad.toml"))
        assert check.returncode == 1 and "is not trusted" in check.stderr and "mqtt.ca_file" in check.stderr
        listener.close()
    finally:
        good.close()
        bad.close()
        b.close()


def test_a_broker_absent_at_start_does_not_stop_edged_which_connects_once_it_is_there(workdir: Path) -> None:
    port = free_port()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # what systemd would be
    notify.bind(str(workdir / "notify.sock"))
    notify.settimeout(30)
    d = start(workdir, port, env={"NOTIFY_SOCKET": str(workdir / "notify.sock")})
    try:
        datagrams = [notify.recv(4096).decode()]
        while "READY=1" not in datagrams[-1].splitlines():
            datagrams.append(notify.recv(4096).decode())
        assert "| mqtt disconnected |" in datagrams[-1], datagrams  # STATUS= says it too
        d.collect("detections", 3)
        assert d.wait_status(lambda s: s.frames_processed > 5).mqtt_state == "disconnected"
        assert "refused the connection" in d.log()
        b = Broker(workdir, port)
        try:
            listener = Listener(port, "edged/#")
            detections(listener, f"edged/{topic_hostname()}/cam0/detections", 3)
            assert d.wait_status(lambda s: s.mqtt_state == "connected").mqtt_state == "connected"
            listener.close()
        finally:
            b.close()
    finally:
        d.close()
        notify.close()


def test_a_broker_killed_mid_stream_drops_counted_zeromq_throughout_and_the_stream_resumes(
    workdir: Path, broker: Broker
) -> None:
    d = start(workdir, broker.port, max_queued=10)
    topic = f"edged/{topic_hostname()}/cam0/detections"
    try:
        listener = Listener(broker.port, "edged/#")
        before = detections(listener, topic, 3)
        listener.close()
        broker.kill()
        # ZeroMQ goes on while the broker is gone; the outbox overflows and counts it.
        outage = d.wait_status(lambda s: s.mqtt_state == "disconnected" and (s.mqtt_drops or {}).get("detections", 0) > 5)
        zmq_during = d.collect("detections", 10)
        assert zmq_during[-1].frame_id > zmq_during[0].frame_id
        broker.start()
        listener = Listener(broker.port, "edged/#")
        after = detections(listener, topic, 12)
        resumed = d.wait_status(lambda s: s.mqtt_state == "connected")
        assert resumed.mqtt_drops is not None and outage.mqtt_drops is not None
        assert resumed.mqtt_drops["detections"] >= outage.mqtt_drops["detections"]
        # The held messages (at most max_queued) come first, then the live stream.
        assert after[0].seq > before[-1].seq and after[-1].frame_id > zmq_during[-1].frame_id
        listener.close()
    finally:
        d.close()


def test_three_boards_publish_to_one_broker_and_one_subscriber_sees_every_stream(workdir: Path, broker: Broker) -> None:
    listener = Listener(broker.port, "edged/#")
    fleet = [start(workdir, broker.port, camera=f"line{i}", name=f"board{i}") for i in range(3)]
    try:
        prefix = f"edged/{topic_hostname()}"
        for i in range(3):
            msgs = detections(listener, f"{prefix}/line{i}/detections", 3, timeout_s=60)
            assert {m.camera_id for m in msgs} == {f"line{i}"}
        statuses = {parse_message(m.payload).camera_id for m in listener.messages if m.topic.endswith("/status")}
        assert statuses == {"line0", "line1", "line2"} or wait_for(
            lambda: (
                {parse_message(m.payload).camera_id for m in listener.messages if m.topic.endswith("/status")}
                == {"line0", "line1", "line2"}
            ),
            30,
        )
    finally:
        for d in fleet:
            d.close()
        listener.close()


@pytest.mark.slow
def test_memory_stays_bounded_through_a_long_outage_at_a_high_frame_rate(workdir: Path) -> None:
    d = start(workdir, free_port(), realtime=False)  # no broker at all, frames as fast as they decode
    try:
        full = d.wait_status(lambda s: (s.mqtt_drops or {}).get("detections", 0) > 0, timeout=60)
        rss_full = rss_kb(d.proc.pid)
        started = time.monotonic()
        while time.monotonic() - started < 30:
            d.collect("status", 1)
        last = d.wait_status(lambda s: True)
        dropped = last.mqtt_drops["detections"] - full.mqtt_drops["detections"]
        assert dropped > 1000, (full, last)  # a high rate, all of it beyond the outbox
        assert rss_kb(d.proc.pid) - rss_full < 8_000  # KB: the outbox holds max_queued, no more
    finally:
        d.close()


def test_sighup_applies_a_new_broker_and_a_removed_section_stops_the_output(workdir: Path, broker: Broker) -> None:
    d = start(workdir, free_port())  # nothing listens there
    config = workdir / "edged.toml"
    try:
        assert d.wait_status(lambda s: s.frames_processed > 3).mqtt_state == "disconnected"
        listener = Listener(broker.port, "edged/#")
        text = config.read_text()
        config.write_text(re.sub(r"mqtt://127\.0\.0\.1:\d+", f"mqtt://127.0.0.1:{broker.port}", text))
        d.signal(signal.SIGHUP)
        detections(listener, f"edged/{topic_hostname()}/cam0/detections", 3)
        assert d.wait_status(lambda s: s.mqtt_state == "connected").mqtt_drops is not None

        config.write_text(text[: text.index("[mqtt]")])
        d.signal(signal.SIGHUP)
        assert d.wait_status(lambda s: s.mqtt_state is None).mqtt_drops is None
        assert wait_for(lambda: state(listener, f"edged/{topic_hostname()}") == b"offline", 10)
        listener.close()
    finally:
        d.close()


def test_a_frozen_broker_is_lost_on_the_keepalive_and_reconnected_after_it_thaws(workdir: Path, broker: Broker) -> None:
    d = start(workdir, broker.port, max_queued=10)  # keepalive_s = 5
    topic = f"edged/{topic_hostname()}/cam0/detections"
    try:
        listener = Listener(broker.port, "edged/#")
        detections(listener, topic, 3)
        listener.close()
        # The statuses from before the first connection say "disconnected" too: read past them.
        d.wait_status(lambda s: s.mqtt_state == "connected")
        assert broker.proc is not None
        broker.proc.send_signal(signal.SIGSTOP)  # the connection stays open, nothing answers
        try:
            frozen = d.wait_status(lambda s: s.mqtt_state == "disconnected", timeout=30)
            assert "lost" in d.log()
            # More frames than the outbox holds (max_queued = 10), all published after the loss:
            # the oldest must have been dropped, however quickly the broker is back. Only frames
            # with detections go to the broker (mqtt.publish_empty is off), so only they count.
            zmq_during: list[DetectionsMessage] = []
            while len(zmq_during) < 15:
                zmq_during += [m for m in d.collect("detections", 1) if isinstance(m, DetectionsMessage) and m.detections]
            assert zmq_during[-1].frame_id > zmq_during[0].frame_id
            assert frozen.frames_processed < zmq_during[-1].frame_id
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        listener = Listener(broker.port, "edged/#")
        assert detections(listener, topic, 12)[-1].frame_id > zmq_during[-1].frame_id  # past the 10 held
        thawed = d.wait_status(lambda s: s.mqtt_state == "connected")
        assert thawed.mqtt_drops is not None and thawed.mqtt_drops["detections"] > 0, (frozen, thawed, d.log())
        listener.close()
    finally:
        d.close()


def test_frames_without_detections_go_to_mqtt_only_with_publish_empty(workdir: Path, broker: Broker) -> None:
    write_video(workdir / "clip.avi", [RED if i % 2 == 0 else (0, 0, 0) for i in range(40)])  # black: nothing found
    listener = Listener(broker.port, "edged/#")
    skips = start(workdir, broker.port, camera="skips", name="skips")
    sends = start(workdir, broker.port, camera="sends", name="sends", publish_empty=True)
    prefix = f"edged/{topic_hostname()}"
    try:
        assert any(not m.detections for m in skips.collect("detections", 8) if isinstance(m, DetectionsMessage))
        assert all(m.detections for m in detections(listener, f"{prefix}/skips/detections", 8))
        assert any(not m.detections for m in detections(listener, f"{prefix}/sends/detections", 8))
    finally:
        skips.close()
        sends.close()
        listener.close()
