"""edged's MQTT output read by another stack than edged's own: mqtt.js (Node-RED's MQTT client), JSON.parse
and ajv (strict, draft 2020-12) in tests/mqtt_client.cjs, against a real Mosquitto and the real daemon,
as docs/outputs.md tells a Node-RED flow to read it. The other MQTT tests read the broker with paho,
the publisher's own library, so a fault the two share (a session a historian of the other protocol
version loses, a retained message or QoS other than documented, a payload a standard validator
refuses, a dedup key that is not one) shows only here.

scripts/setup test installs npm (apt), then the pinned node, mqtt, ajv and ajv-formats (npm, in .node-opcua/)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon import RunningDaemon, free_port
from mosquitto import Broker, make_ca, make_password_file, make_server_cert
from node_clients import NODE_MODULES, node
from test_journal import rows
from test_journal import start as journaled
from waiting import wait_for

from edged.messages import StatusMessage

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
CLIENT = Path(__file__).with_name("mqtt_client.cjs")
SCHEMA = REPO / "edged" / "messages.schema.json"
DOCS = REPO / "docs" / "outputs.md"
PREFIX = "acme/plant1/line3/board3"
# The topic filters a flow takes from docs/outputs.md: a board's state at the level of its line, a
# plant's verdicts, this board's status and trigger errors.
HISTORIAN = ["acme/plant1/line3/+/state", "acme/plant1/+/+/+/verdict", f"{PREFIX}/+/status", f"{PREFIX}/+/trigger/error"]
DASHBOARD = ["acme/plant1/line3/+/state", f"{PREFIX}/+/status", "acme/plant1/+/+/+/detections"]
# Two historians, one per protocol version a flow's broker node offers, each with a persistent session:
# a fixed client id, clean session (3.1.1) or clean start (5) off, and on MQTT 5 a session expiry
# interval, without which the broker ends the session as the client disconnects.
HISTORIANS: dict[str, dict[str, Any]] = {
    "historian-311": {"protocolVersion": 4, "clean": False},
    "historian-5": {"protocolVersion": 5, "clean": False, "properties": {"sessionExpiryInterval": 3600}},
}
KEY = ("board_id", "run_id", "camera_id", "seq")  # what docs/outputs.md tells a historian to dedup on
TIMEOUT_S = 20.0


class Node:
    """tests/mqtt_client.cjs: its named mqtt.js clients take commands, and every event they print is kept."""

    def __init__(self, port: int, ca: Path, password: str) -> None:
        self.url = f"mqtts://127.0.0.1:{port}"
        self.ca = ca
        self.password = password
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [node("mqtt", "ajv", "ajv-formats"), str(CLIENT), json.dumps({"schema": str(SCHEMA)})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "NODE_PATH": str(NODE_MODULES)},
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.events.append(json.loads(line))

    def command(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def connect(self, name: str, subscribe: list[str], **options: Any) -> dict[str, Any]:
        """Connect ``name`` over TLS with the CA and the documented credentials; its connect event once
        it has a session (the broker's, or its own subscriptions made)."""
        options = {"clientId": name, "username": "nodered", "password": self.password, "reconnectPeriod": 200, **options}
        since = self.mark()
        self.command(op="connect", name=name, url=self.url, ca_file=str(self.ca), options=options, subscribe=subscribe)
        connected = self.wait(lambda e: e["event"] == "connect" and e["name"] == name, since=since)[0]
        if not connected["session_present"]:
            self.wait(lambda e: e["event"] == "subscribed" and e["name"] == name, since=since)
        return connected

    def end(self, name: str) -> None:
        since = self.mark()
        self.command(op="end", name=name)
        self.wait(lambda e: e["event"] == "ended" and e["name"] == name, since=since)

    def mark(self) -> int:
        """Where the events stand now: `wait` from here on."""
        with self._lock:
            return len(self.events)

    def of(self, match: Callable[[dict[str, Any]], bool], since: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events[since:] if match(e)]

    def wait(self, match: Callable[[dict[str, Any]], bool], count: int = 1, since: int = 0) -> list[dict[str, Any]]:
        """The events from ``since`` on that ``match``, once there are ``count``."""
        if not wait_for(lambda: len(self.of(match, since)) >= count, TIMEOUT_S):
            got = len(self.of(match, since))
            raise AssertionError(f"{got} of {count} event(s) in {TIMEOUT_S} s; last: {self.events[-5:]}")
        return self.of(match, since)

    def messages(self, name: str, suffix: str) -> list[dict[str, Any]]:
        return self.of(lambda e: e["event"] == "message" and e["name"] == name and e["topic"].endswith(suffix))

    def close(self) -> str:
        """Quit; what node said on stderr."""
        if self.proc.poll() is None:
            self.command(op="quit")
        try:
            _, errors = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, errors = self.proc.communicate()
        return errors


@pytest.fixture
def tls(tmp_path: Path) -> Iterator[tuple[Broker, Path]]:
    """A Mosquitto that saves its sessions, over TLS only, with users edged and nodered; and its CA."""
    server = make_server_cert(tmp_path, make_ca(tmp_path, "plant1-ca"))
    users = make_password_file(tmp_path / "users", "edged", "edged-secret")
    subprocess.run(["mosquitto_passwd", "-b", str(users), "nodered", "nodered-secret"], check=True, timeout=30)
    broker = Broker(tmp_path, free_port(), password_file=users, tls=server, persistent=True)
    yield broker, server.ca
    broker.close()


def mqtt_docs() -> str:
    """docs/outputs.md's MQTT section, what a Node-RED user reads."""
    return DOCS.read_text().split("\n## Sending detections to a broker\n", 1)[1].split("\n## ", 1)[0]


def documented_topic(topic: str) -> bool:
    """Whether ``topic`` is one of the MQTT section's table, PREFIX and CAMERA filled in."""
    patterns = re.findall(r"^\| `(PREFIX/[^`]+)` \|", mqtt_docs(), re.MULTILINE)
    assert patterns, "docs/outputs.md's MQTT section has no topic table"
    return any(re.fullmatch(p.replace("PREFIX", re.escape(PREFIX)).replace("CAMERA", "[^/]+"), topic) for p in patterns)


def status_of(d: RunningDaemon, condition: Callable[[StatusMessage], bool]) -> StatusMessage:
    return d.wait_status(condition, timeout=TIMEOUT_S)


def recorded(status: StatusMessage) -> int:
    return status.journal.recorded if status.journal is not None else 0


Event = dict[str, Any]


def on(
    name: str, topic: str | None = None, text: str | None = None, where: Callable[[Event], bool] = lambda m: True
) -> Callable[[Event], bool]:
    """Matches client ``name``'s messages on ``PREFIX/topic``, of ``text`` (the state's), whose JSON satisfies ``where``."""
    return lambda e: (
        e["event"] == "message"
        and e["name"] == name
        and (topic is None or e["topic"] == f"{PREFIX}/{topic}")
        and (text is None or e.get("text") == text)
        and (not e["json"] or where(e["message"]))
    )


def key(verdict: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(verdict[field] for field in KEY)


def test_docs_tell_an_mqtt5_historian_the_session_expiry_its_persistent_session_needs() -> None:
    """On MQTT 5 clean start off alone keeps no session past a disconnect (its expiry defaults to 0):
    a Node-RED historian set up as the docs say must get what it missed on either protocol version."""
    persistent = re.search(r"persistent session \(([^)]*)\)", mqtt_docs().replace("\n", " "))
    assert persistent is not None, "docs/outputs.md recommends no persistent session"
    assert "clean session off" in persistent.group(1) and "session expiry" in persistent.group(1), persistent.group(0)


def test_a_node_red_historian_gets_every_verdict_keyed_once_across_an_outage_a_restart_and_its_own_absence(
    tmp_path: Path, tls: tuple[Broker, Path]
) -> None:
    """mqtt.js historians (MQTT 3.1.1 and 5, persistent sessions, QoS 1, TLS with the plant's CA and a
    password) subscribe with the documented wildcards; edged starts, answers a trigger sent as the docs
    show, then the historians go away, the broker stops, edged restarts during the outage, the broker
    comes back, and so do the historians: each gets every verdict the journal holds, valid in ajv, the
    outage's marked replayed, no two distinct verdicts under one dedup key; a dashboard connecting
    later finds the retained state and status; the Last Will's and the stop's state is offline."""
    broker, ca = tls
    password = tmp_path / "mqtt.password"
    password.write_text("edged-secret\n")
    password.chmod(0o600)
    clip = {"type": "file", "path": "clip.avi", "loop": True}
    sections: dict[str, Any] = {
        "source": [{**clip, "camera_id": "cam0", "max_fps": 8}, {**clip, "camera_id": "gate", "trigger": "request"}],
        "trigger": {"endpoint": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 5.0},
        "mqtt": {
            "url": f"mqtts://127.0.0.1:{broker.port}",
            "username": "edged",
            "password_file": str(password),
            "ca_file": str(ca),
            "topic_prefix": PREFIX,
            "keepalive_s": 5,
        },
    }
    flows = Node(broker.port, ca, "nodered-secret")
    d = None
    try:
        for name, options in HISTORIANS.items():
            assert not flows.connect(name, HISTORIAN, **options)["session_present"]
        d = journaled(tmp_path, **sections)
        config = tmp_path / "edged.toml"
        for name in HISTORIANS:
            flows.wait(on(name, "state", "online"))
            flows.wait(on(name, "cam0/verdict"))

        # A request from the flow, exactly as the docs show it: the answer comes on the verdict topic.
        flows.command(
            op="publish", name="historian-5", topic=f"{PREFIX}/gate/trigger", payload='{"part_id": "A-1017"}', qos=1
        )
        for name in HISTORIANS:
            flows.wait(on(name, "gate/verdict", where=lambda m: m["part_id"] == "A-1017"))

        # A dashboard connecting now: the retained state and each camera's last status, and detections.
        flows.connect("dashboard", DASHBOARD, protocolVersion=5)
        for topic in ("state", "cam0/status", "gate/status", "cam0/detections"):
            flows.wait(on("dashboard", topic))
        flows.end("dashboard")

        # The historians go away (their sessions stay), the broker stops, edged restarts meanwhile.
        for name in HISTORIANS:
            flows.end(name)
        # The statuses from before the first connection say "disconnected" too, and wait unread: read
        # past them, or the outage below could end before edged had recorded a verdict in it.
        status_of(d, lambda s: s.camera_id == "cam0" and s.mqtt_state == "connected")
        broker.stop()
        before = recorded(status_of(d, lambda s: s.camera_id == "cam0" and s.mqtt_state == "disconnected"))
        status_of(d, lambda s: s.camera_id == "cam0" and recorded(s) >= before + 3)
        assert d.stop() == 0, d.log()
        d = RunningDaemon(config, d.endpoint)
        run2 = status_of(d, lambda s: s.camera_id == "cam0" and recorded(s) >= 3)
        assert run2.mqtt_state == "disconnected"

        # The broker back: edged replays the outage's verdicts to it, then sends live ones; a flow
        # watching without a session sees the first live one of this run.
        broker.start()
        flows.connect("watch", [f"{PREFIX}/cam0/verdict"], protocolVersion=4)
        live = flows.wait(on("watch", "cam0/verdict", where=lambda m: m["run_id"] == run2.run_id and not m["replayed"]))
        live_seq = live[0]["message"]["seq"]
        flows.end("watch")

        # The historians come back to their sessions: what they missed arrives, and live verdicts after.
        for name, options in HISTORIANS.items():
            assert flows.connect(name, HISTORIAN, **options)["session_present"], name
        for name in HISTORIANS:
            flows.wait(on(name, "cam0/verdict", where=lambda m: m["run_id"] == run2.run_id and m["seq"] > live_seq))
        # Away again while edged stops: back, each finds the offline state waiting in its session.
        for name in HISTORIANS:
            flows.end(name)
        assert d.stop() == 0, d.log()
        back = flows.mark()
        for name, options in HISTORIANS.items():
            assert flows.connect(name, HISTORIAN, **options)["session_present"], name
            flows.wait(on(name, "state", "offline"), since=back)
    except BaseException:
        print(f"edged's log:\n{d.log_path.read_text()[-4000:] if d else ''}\nnode:\n{flows.close()[-4000:]}")
        raise
    finally:
        if d is not None:
            d.close()
        flows.close()

    journal = [
        json.loads(str(m))
        for (m,) in rows(tmp_path / "journal.sqlite", "SELECT message FROM entries WHERE kind = 'verdict' ORDER BY id")
    ]
    assert len({key(v) for v in journal}) == len(journal), "the journal holds two verdicts under one dedup key"
    received = flows.of(lambda e: e["event"] == "message")
    assert [e["topic"] for e in received if not documented_topic(e["topic"])] == []
    dashboard = [e for e in received if e["name"] == "dashboard"]
    assert {e["qos"] for e in dashboard if e["topic"].endswith("/detections")} == {0}  # qos_detections
    assert all(e["qos"] == 1 for e in dashboard if e["topic"].endswith(("/state", "/status")))  # qos_events
    found = {e["topic"]: e for e in reversed(dashboard)}  # what it found on subscribing: retained
    assert all(e["retain"] for topic, e in found.items() if topic.endswith(("/state", "/status"))), found
    got: dict[str, list[dict[str, Any]]] = {}
    for name in HISTORIANS:
        events = flows.of(on(name))
        for e in events:
            assert e["utf8"] and (e["json"] or e["topic"] == f"{PREFIX}/state"), e
            assert e.get("schema_errors", []) == [], (e["topic"], e["schema_errors"])
            assert e["qos"] == 1, (e["topic"], e["qos"])  # state, status and verdicts: qos_events, 1
        states = [e["text"] for e in events if e["topic"] == f"{PREFIX}/state"]
        assert states[0] == "online" and states[-1] == "offline" and set(states) == {"online", "offline"}, states
        verdicts = [e["message"] for e in events if e["topic"].endswith("/verdict")]
        by_key: dict[tuple[Any, ...], dict[str, Any]] = {}
        for v in verdicts:  # at least once: a verdict may come twice, but a key never names two
            seen = by_key.setdefault(key(v), v)
            assert {**seen, "replayed": None} == {**v, "replayed": None}, (seen, v)
        got[name] = verdicts
        # Every verdict the journal holds from the first this historian got to the last it got.
        keys = [key(v) for v in journal]
        first, last = keys.index(key(verdicts[0])), keys.index(key(verdicts[-1]))
        missing = [k for k in keys[first : last + 1] if k not in by_key]
        assert missing == [], f"{name} missed {len(missing)} verdict(s): {missing[:5]}"
        runs = {v["run_id"] for v in verdicts}
        assert len(runs) == 2 and run2.run_id in runs, runs
        # Those recorded while the broker was away came replayed (of both runs), the live ones after not.
        first = [(v["seq"], v["replayed"]) for v in verdicts if v["run_id"] != run2.run_id and v["camera_id"] == "cam0"]
        recorded_first = [v["seq"] for v in journal if v["run_id"] != run2.run_id and v["camera_id"] == "cam0"]
        assert {v["run_id"] for v in verdicts if v["replayed"]} == runs, (
            f"{name}: both runs' outage verdicts come replayed; of the first run, got (seq, replayed) {first[-12:]}, "
            f"the journal's last seqs {recorded_first[-12:]}"
        )
        assert not any(v["replayed"] for v in verdicts if v["run_id"] == run2.run_id and v["seq"] >= live_seq)
        assert [v["part_id"] for v in verdicts if v["camera_id"] == "gate"] == ["A-1017"]
    assert {key(v) for v in got["historian-311"]} == {key(v) for v in got["historian-5"]}
