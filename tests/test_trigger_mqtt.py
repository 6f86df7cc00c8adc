"""Triggers from the broker: ``PREFIX/CAMERA/trigger`` on the running daemon, against a real Mosquitto.

Requests go in with Debian's ``mosquitto_pub``; verdicts and errors are read with ``mosquitto_sub`` or an
independent paho client, and the ZeroMQ side with a real REQ socket, as in ``tests/test_trigger.py``.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon import RunningDaemon, free_port
from mosquitto import Broker, Gate, Listener
from test_trigger import Requester, ready, running
from waiting import wait_for

from edged.config import PublishConfig, TriggerConfig
from edged.messages import TriggerError, VerdictMessage, parse_message
from edged.mqtt import MAX_TRIGGER_BYTES, MqttOutput
from edged.settings.mqtt import MqttConfig
from edged.trigger import Request, TriggerServer

pytestmark = pytest.mark.integration

PREFIX = "site1/line2/board3"
VERDICT, TRIGGER, ERROR = (f"{PREFIX}/cam0/{name}" for name in ("verdict", "trigger", "trigger/error"))
SUBSCRIBED = f"MQTT: taking trigger requests on {TRIGGER}"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path, free_port())
    yield b
    b.close()


def mqtt(broker: Broker) -> dict[str, Any]:
    return {"url": f"mqtt://127.0.0.1:{broker.port}", "topic_prefix": PREFIX, "keepalive_s": 5}


def publish(
    broker: Broker,
    payload: str | bytes,
    *,
    retain: bool = False,
    lines: bool = False,
    topic: str = TRIGGER,
    qos: int = 1,
) -> None:
    """On the trigger topic (cam0's unless ``topic`` says) with ``mosquitto_pub`` at ``qos``, returning
    once the broker has it: one message, or with ``lines`` one per line of ``payload``, in order, from one client."""
    message = payload if isinstance(payload, bytes) else payload.encode()
    command = [b"mosquitto_pub", b"-h", b"127.0.0.1", b"-p", b"%d" % broker.port, b"-t", topic.encode(), b"-q", b"%d" % qos]
    command += [b"-l"] if lines else [b"-m", message]
    command += [b"-r"] if retain else []
    subprocess.run(command, input=message if lines else None, check=True, capture_output=True, timeout=30)


def subscribed(d: RunningDaemon, times: int = 1) -> None:
    """The daemon has the broker's acknowledgement of its ``times``-th trigger subscription."""
    assert wait_for(lambda: d.log().count(SUBSCRIBED) >= times, 30), d.log()


def verdicts(listener: Listener, count: int) -> list[VerdictMessage]:
    msgs = [parse_message(m.payload) for m in listener.wait(VERDICT, count)]
    assert all(isinstance(m, VerdictMessage) for m in msgs), msgs
    return [m for m in msgs if isinstance(m, VerdictMessage)]


def errors(listener: Listener, count: int) -> dict[str | None, TriggerError]:
    msgs = [parse_message(m.payload) for m in listener.wait(ERROR, count)]
    assert all(isinstance(m, TriggerError) for m in msgs), msgs
    return {m.part_id: m for m in msgs if isinstance(m, TriggerError)}


def test_a_trigger_from_the_broker_gets_the_verdict_of_a_frame_captured_after_it(tmp_path: Path, broker: Broker) -> None:
    # At 2 fps a frame up to half a second old always waits in the latest-frame slot: taking it
    # would give a capture time before the trigger was published.
    with running(tmp_path, mqtt=mqtt(broker)) as d:
        listener = Listener(broker.port, f"{PREFIX}/#")
        try:
            subscribed(d)
            ready(d, frames=3)
            for i in range(3):
                sent_ns = time.time_ns()
                publish(broker, f'{{"part_id": "P{i}"}}')
                verdict = verdicts(listener, i + 1)[-1]
                assert (verdict.part_id, verdict.verdict) == (f"P{i}", "ng") and verdict.capture_time_ns > sent_ns, verdict
            # The verdict is a verdict like any other: on ZeroMQ's verdict topic too, the same message.
            on_zmq = d.collect("verdict", 1, timeout=30)[0]
            assert on_zmq in verdicts(listener, 3)
            assert listener.on(ERROR) == []
        finally:
            listener.close()


def test_malformed_and_retained_triggers_are_counted_logged_once_and_the_next_one_is_answered(
    tmp_path: Path, broker: Broker
) -> None:
    publish(broker, '{"part_id": "stale"}', retain=True)  # the broker replays it on every subscription
    with running(tmp_path, mqtt=mqtt(broker)) as d:
        listener = Listener(broker.port, f"{PREFIX}/#")
        try:
            subscribed(d)
            ready(d)
            for payload in ("not json", '{"part_id": 5}', '{"part": "A"}', "[1, 2]", b"\xff\xfe{"):
                publish(broker, payload)
            status = d.wait_status(lambda s: (s.mqtt_drops or {}).get("trigger") == 6, timeout=30)
            assert status.mqtt_drops is not None and status.mqtt_drops["trigger/error"] == 0
            publish(broker, '{"part_id": "good"}')
            assert [v.part_id for v in verdicts(listener, 1)] == ["good"]  # the stale one was never inspected
            log = d.log()
            assert log.count("MQTT trigger skipped") == 1 and "a request is JSON" in log, log
            assert "a retained trigger on site1/line2/board3/cam0/trigger ignored" in log
            assert listener.on(ERROR) == [] and d.proc.poll() is None
        finally:
            listener.close()


def test_a_trigger_too_large_is_refused_unread_counted_and_the_next_one_is_answered(tmp_path: Path, broker: Broker) -> None:
    big = b'{"part_id": "big", "pad": "' + b"x" * (8 * MAX_TRIGGER_BYTES) + b'"}'  # 8x the cap
    with running(tmp_path, mqtt=mqtt(broker)) as d:
        listener = Listener(broker.port, f"{PREFIX}/#")
        try:
            subscribed(d)
            ready(d)
            for qos in (0, 1, 2):  # each acknowledged as its QoS asks, or the broker would stop sending
                publish(broker, big, qos=qos)
            status = d.wait_status(lambda s: s.drops.get("mqtt_too_large") == 3, timeout=30)
            assert status.mqtt_drops is not None and status.mqtt_drops["trigger"] == 0  # never read to be judged
            publish(broker, '{"part_id": "good"}', qos=2)
            assert [v.part_id for v in verdicts(listener, 1)] == ["good"]
            log = d.log()
            assert log.count("refused unread: a trigger is at most 1024 bytes") == 1, log
            assert f"a {len(big)}-byte message on {TRIGGER} refused unread" in log
            assert log.count(SUBSCRIBED) == 1 and "MQTT: connection to" not in log  # one connection throughout
            assert listener.on(ERROR) == [] and d.proc.poll() is None
        finally:
            listener.close()


def test_broker_and_zeromq_requests_share_one_queue_and_beyond_it_the_broker_gets_busy(
    tmp_path: Path, broker: Broker
) -> None:
    # One image every 60 s: after the first, no frame comes within any request's 10 s. With queue = 1
    # there is room for two requests of the camera, from either origin: whichever of the three the
    # loop stamps last (ZeroMQ's is stamped when the loop reads it, the broker's as they arrive) is busy.
    with running(tmp_path, fps=1 / 60, trigger={"timeout_s": 10.0, "queue": 1}, mqtt=mqtt(broker)) as d:
        ask = Requester(d.trigger)  # type: ignore[attr-defined]
        listener = Listener(broker.port, f"{PREFIX}/#")
        try:
            subscribed(d)
            ready(d)
            first = ask.send(b'{"part_id": "A"}')
            publish(broker, '{"part_id": "B"}\n{"part_id": "C"}', lines=True)
            replies = errors(listener, 2)
            reply = ask.reply(first)
            assert isinstance(reply, TriggerError) and reply.part_id == "A", reply
            replies["A"] = reply
            assert sorted(r.error for r in replies.values()) == ["busy", "timeout", "timeout"], replies
            timed_out = [r for r in replies.values() if r.error == "timeout"]
            assert all("no frame captured after the request within 10 s" in r.detail for r in timed_out), replies
            assert listener.on(VERDICT) == []
        finally:
            listener.close()
            ask.close()


def test_after_the_broker_restarts_edged_subscribes_again_and_triggers_are_answered(tmp_path: Path, broker: Broker) -> None:
    with running(tmp_path, mqtt=mqtt(broker)) as d:
        listener = Listener(broker.port, f"{PREFIX}/#")
        try:
            subscribed(d)
            ready(d)
            publish(broker, '{"part_id": "before"}')
            assert verdicts(listener, 1)[0].part_id == "before"
            listener.close()
            d.wait_status(lambda s: s.mqtt_state == "connected")  # past the statuses from before the connection
            broker.kill()
            d.wait_status(lambda s: s.mqtt_state == "disconnected")
            broker.start()
            listener = Listener(broker.port, f"{PREFIX}/#")
            subscribed(d, times=2)  # a clean session: the old subscription died with the broker
            publish(broker, '{"part_id": "after"}')
            # "before" may come again first (at least once): the broker died before acknowledging it.
            seen = next(got for n in itertools.count(1) if (got := verdicts(listener, n))[-1].part_id != "before")
            assert [v.part_id for v in seen] == ["before"] * (len(seen) - 1) + ["after"], seen
        finally:
            listener.close()


def test_free_running_verdicts_reach_the_verdict_topic(tmp_path: Path, broker: Broker) -> None:
    inspect = {"ng_classes": ["crack"]}
    with running(tmp_path, trigger={"mode": "free"}, inspect=inspect, mqtt=mqtt(broker)) as d:
        d.wait_status(lambda s: s.mqtt_state == "connected")
        sub = subprocess.run(
            ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-t", VERDICT, "-v", "-C", "2", "-W", "60"],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert sub.returncode == 0, sub.stderr
        for line in sub.stdout.splitlines():
            topic, payload = line.split(" ", 1)
            msg = parse_message(payload.encode())
            assert topic == VERDICT and isinstance(msg, VerdictMessage), line
            assert (msg.verdict, msg.part_id, [r.label for r in msg.reasons]) == ("ng", None, ["crack"])
        assert SUBSCRIBED not in d.log()  # free-running: no trigger topic


def test_sigterm_answers_the_requests_from_the_broker_that_edged_is_stopping(tmp_path: Path, broker: Broker) -> None:
    # One image every 60 s and a 30 s timeout: both requests are still waiting when SIGTERM comes.
    with running(tmp_path, fps=1 / 60, trigger={"timeout_s": 30.0}, mqtt=mqtt(broker)) as d:
        listener = Listener(broker.port, f"{PREFIX}/#")
        try:
            subscribed(d)
            ready(d)
            publish(broker, '{"part_id": "A"}')
            publish(broker, '{"part_id": "B"}')
            # The broker delivers in order: once edged has counted this malformed one, it has taken A and B.
            publish(broker, "not a request")
            d.wait_status(lambda s: (s.mqtt_drops or {}).get("trigger") == 1, timeout=30)
            assert d.stop(timeout=10) == 0
            replies = errors(listener, 2)
            assert {part: e.error for part, e in replies.items()} == {"A": "stopping", "B": "stopping"}, replies
        finally:
            listener.close()


def _next(server: TriggerServer, camera_id: str) -> Request:
    """The next request for ``camera_id``, read as the daemon loop reads them."""
    deadline = time.monotonic() + 30
    while (request := server.next(camera_id)) is None:
        assert time.monotonic() < deadline, f"no request for {camera_id}"
        if zmq.select(server.fds, [], [], 1)[0]:
            server.collect()
    return request


def _collected(server: TriggerServer) -> bool:
    """The loop's turn: what has arrived is read (and answered at once where it cannot wait)."""
    server.collect()
    return True


def test_each_camera_in_request_mode_takes_triggers_on_its_own_topic_and_errors_go_back_there(
    tmp_path: Path, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edged.mqtt")
    topic = {
        camera: {kind: f"{PREFIX}/{camera}/{kind}" for kind in ("trigger", "trigger/error")} for camera in ("top", "side")
    }
    mqtt_cfg = MqttConfig.model_validate(mqtt(broker))
    output = MqttOutput(mqtt_cfg, ["top", "side", "front"])
    trigger = TriggerConfig(mode="request", endpoint=f"ipc://{tmp_path / 'trigger.sock'}", queue=1)
    server = TriggerServer(trigger, PublishConfig(), ["top", "side"])
    listener = Listener(broker.port, f"{PREFIX}/#")
    try:
        server.attach(output)
        wanted = [f"MQTT: taking trigger requests on {topic[camera]['trigger']}" for camera in ("top", "side")]
        assert wait_for(lambda: all(line in caplog.text for line in wanted), 30), caplog.text
        publish(broker, '{"part_id": "A"}', topic=topic["top"]["trigger"])
        publish(broker, '{"part_id": "B", "camera_id": "side"}', topic=topic["side"]["trigger"])
        publish(broker, '{"part_id": "X", "camera_id": "top"}', topic=topic["side"]["trigger"])  # not the topic's camera
        a, b = _next(server, "top"), _next(server, "side")
        assert [(r.origin, r.camera_id, r.part_id) for r in (a, b)] == [("mqtt", "top", "A"), ("mqtt", "side", "B")]
        assert wait_for(lambda: output.outbox.counts()["trigger"] == 1, 30), output.outbox.counts()
        assert "camera_id 'top' on the trigger topic of camera side" in caplog.text
        publish(broker, '{"part_id": "C"}\n{"part_id": "D"}', topic=topic["side"]["trigger"], lines=True)
        assert wait_for(lambda: _collected(server) and listener.on(topic["side"]["trigger/error"]) != [], 30)
        busy = parse_message(listener.on(topic["side"]["trigger/error"])[0].payload)  # queue = 1: C waits, D is busy
        assert isinstance(busy, TriggerError) and (busy.error, busy.camera_id, busy.part_id) == ("busy", "side", "D"), busy
        server.answer(a, server.error(a, "timeout", "no frame"))
        timeout = parse_message(listener.wait(topic["top"]["trigger/error"])[0].payload)
        assert isinstance(timeout, TriggerError) and (timeout.error, timeout.camera_id, timeout.part_id) == (
            "timeout",
            "top",
            "A",
        )
        server.follow_cameras(["top"])  # a reload: side no longer takes requests
        removed = parse_message(listener.wait(topic["side"]["trigger/error"], 2)[1].payload)
        assert isinstance(removed, TriggerError) and (removed.error, removed.part_id) == ("bad_request", "C"), removed
        unsubscribed = f"MQTT: no longer taking trigger requests on {topic['side']['trigger']}"
        assert wait_for(lambda: unsubscribed in caplog.text, 30), caplog.text
        publish(broker, '{"part_id": "E"}', topic=topic["side"]["trigger"])
        publish(broker, '{"part_id": "F"}', topic=topic["top"]["trigger"])
        assert _next(server, "top").part_id == "F"
        assert output.outbox.counts()["trigger"] == 1 and len(listener.on(topic["side"]["trigger/error"])) == 2  # E unseen
    finally:
        server.close()
        output.close()
        listener.close()


def test_a_flood_of_triggers_never_pushes_an_answer_a_verdict_or_detections_out_of_the_outbox(
    tmp_path: Path, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="edged.mqtt")
    gate = Gate(broker.port)  # edged's link alone can be cut; the listener stays on the broker throughout
    output = MqttOutput(
        MqttConfig.model_validate({**mqtt(broker), "url": f"mqtt://127.0.0.1:{gate.port}", "max_queued": 2}),
        ["cam0", "side"],
    )
    # queue = 1: two requests per camera, and the inbox holds four for the loop
    trigger = TriggerConfig(mode="request", endpoint=f"ipc://{tmp_path / 'trigger.sock'}", queue=1)
    server = TriggerServer(trigger, PublishConfig(), ["cam0", "side"])
    listener = Listener(broker.port, f"{PREFIX}/#")
    try:
        server.attach(output)
        assert wait_for(lambda: caplog.text.count("MQTT: taking trigger requests on") == 2, 30), caplog.text
        publish(broker, '{"part_id": "L"}')
        legit = _next(server, "cam0")
        publish(broker, "\n".join(f'{{"part_id": "F{i}"}}' for i in range(40)), lines=True)
        busy = errors(listener, 36)  # F0..F3 wait in the inbox for the loop; the rest are refused at once
        assert {e.error for e in busy.values()} == {"busy"} and set(busy) == {f"F{i}" for i in range(4, 40)}
        gate.cut()
        assert wait_for(lambda: output.state == "disconnected", 30)
        # The loop's turn: L's verdict and the other camera's detections, then F0..F3 read: two wait, two are busy.
        verdict = VerdictMessage(
            camera_id="cam0",
            seq=0,
            frame_id=1,
            capture_time_ns=1,
            part_id="L",
            verdict="ok",
            reasons=[],
            verdict_latency_ms=1,
        )
        server.answer(legit, verdict)
        output.send("verdict", verdict.model_dump_json().encode(), "cam0")
        output.send("detections", b"side's detections", "side")
        server.collect()
        assert output.outbox.counts() == {
            "detections": 0,
            "status": 0,
            "verdict": 0,
            "trigger/error": 0,
            "trigger": 0,
            "refusals": 0,
        }
        gate.reopen()  # edged reconnects: everything held goes out
        assert [v.part_id for v in verdicts(listener, 1)] == ["L"]
        assert [m.payload for m in listener.wait(f"{PREFIX}/side/detections")] == [b"side's detections"]
        # One answer each, L's its verdict. An answer the broker had not acknowledged when the link
        # was cut is sent again (QoS 1: at least once), so it may arrive twice, the same answer.
        answers: dict[str | None, set[bytes]] = defaultdict(set)

        def answered() -> bool:
            answers.clear()
            for m in listener.on(ERROR):
                answers[parse_message(m.payload).part_id].add(m.payload)
            return len(answers) >= 38

        assert wait_for(answered, 30), sorted(answers, key=str)
        assert set(answers) == {f"F{i}" for i in range(2, 40)} and all(len(a) == 1 for a in answers.values()), answers
        assert {e.error for e in errors(listener, 38).values()} == {"busy"}
    finally:
        server.close()
        output.close()
        listener.close()
        gate.close()
