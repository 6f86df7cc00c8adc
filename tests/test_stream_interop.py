"""The ZeroMQ stream read by another stack than edged's own: zeromq.js (its own libzmq), JSON.parse and
ajv (a standard JSON Schema validator) in tests/stream_client.cjs, against the real daemon, as users'
dashboards, MES bridges and Node-RED flows read it. The other tests read it with pyzmq and the very
pydantic models that wrote it, so a fault the two share (a schema its own messages fail in a standard
validator, a field the docs promise missing, a number JavaScript mangles, JSON that is not standard,
a topic that is not the documented one, keys other bindings cannot load) shows only here.

scripts/setup test installs npm (apt), then the pinned node, zeromq, ajv and ajv-formats (npm, in .node-opcua/)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import IO, Any

import pytest
from daemon import edged_command, free_port, images_config, run_cli, write_config
from node_clients import NODE_MODULES, node

from edged.config import Settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
CLIENT = Path(__file__).with_name("stream_client.cjs")
SCHEMA = REPO / "edged" / "messages.schema.json"
DOCS = REPO / "docs" / "outputs.md"
TASKS = Path(__file__).parent / "data" / "tasks"
PREFIX = "edged"
CAMERA = "cam0"
# What docs/outputs.md's message tables name that these daemons have no reason to send, and why.
NOT_CONFIGURED = {
    "mqtt_state": "[mqtt] is off",
    "mqtt_drops": "[mqtt] is off",
    "candidate": "[model.candidate] is off",
    "live_frames": "[model.candidate] is off",
    "live_delayed": "[model.candidate] is off",
    "live_delay_ms": "[model.candidate] is off",
    "live_delay": "[model.candidate] is off",
    "note": "only a defect within its size limits has it",
    **dict.fromkeys(
        ("memory", "limit_bytes", "used_bytes", "cgroup_bytes", "oom_kills"),
        "edged's cgroup may have no memory limit where the tests run",
    ),
}
# Half a microsecond: what the docs promise of a *_ms copy ("under a microsecond"), read as a double.
MS_TWIN_NS = 500


def read_stream(on: dict[str, Callable[[], None]] | None = None, **arguments: Any) -> list[dict[str, Any]]:
    """The events of one run of the node client, which must have received what it wanted; ``on`` maps
    an event to what the test does as it comes."""
    arguments = {"schema": str(SCHEMA), "timeout_ms": 20000, **arguments}
    proc = subprocess.Popen(
        [node("zeromq", "ajv", "ajv-formats"), str(CLIENT), json.dumps(arguments)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NODE_PATH": str(NODE_MODULES)},
    )
    stuck = threading.Timer(40, proc.kill)  # the client ends itself after timeout_ms; this if it cannot
    stuck.start()
    events = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith('{"event"'):
                events.append(json.loads(line))
                (on or {}).get(events[-1]["event"], lambda: None)()
    finally:
        stuck.cancel()
        proc.kill()
        _, errors = proc.communicate()
    assert proc.returncode == 0 and events and events[-1]["event"] == "done", json.dumps(events[-3:]) + errors
    return events


class Daemon:
    """`edged run` on ``config`` as a subprocess, started again by `restart`; its output in one log."""

    def __init__(self, config: Path, log: IO[str]) -> None:
        self.config = config
        self._log = log
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            edged_command("run", "--config", str(self.config)), stdout=self._log, stderr=subprocess.STDOUT
        )

    def restart(self) -> None:
        """Stopped as systemd stops it (SIGTERM), then started again."""
        self.proc.terminate()
        assert self.proc.wait(10) == 0
        self.proc = self._start()


@contextmanager
def daemon(config: Path) -> Iterator[Daemon]:
    """`edged run` for as long as the client reads; its log shown when a check fails."""
    log_path = config.with_suffix(".log")
    with log_path.open("w") as log:
        running = Daemon(config, log)
        try:
            yield running
        except BaseException:
            print(f"edged's log:\n{log_path.read_text()[-4000:]}")  # shown with the failure
            raise
        finally:
            running.proc.kill()
            running.proc.wait()


def documented_fields(kind: str, tasks: set[str]) -> set[str]:
    """The backquoted names in docs/outputs.md's "Messages" row for topic ``kind``, and for detections
    those of the list below the table for each of ``tasks``."""
    text = DOCS.read_text()
    section = text[text.index("\n## Messages\n") :]
    section = section[: section.index("\n## ", 1)]
    row = re.search(rf"^\| `{PREFIX}/{kind}/<camera_id>` \| (.*) \|$", section, re.MULTILINE)
    assert row is not None, f"docs/outputs.md has no row for {PREFIX}/{kind}/<camera_id>"
    named = row.group(1)
    if kind == "detections":
        by_task = section[section.index("What a detections message holds") : section.index("The schema is generated")]
        items = {item.split("`", 1)[0]: item for item in by_task.split("\n- `")[1:]}
        assert tasks <= items.keys(), f"docs/outputs.md does not say what a {sorted(tasks - items.keys())} model sends"
        named += "".join(items[task] for task in tasks)
    return set(re.findall(r"`([a-z_0-9]+)`", named))


def schema_names(schema: dict[str, Any]) -> tuple[set[str], set[str]]:
    """Every property name anywhere in ``schema``, and every value its enums and consts allow."""
    fields: set[str] = set()
    values: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            fields.update(node.get("properties", {}))
            values.update(v for v in [*node.get("enum", []), node.get("const")] if isinstance(v, str))
            for inner in node.values():
                walk(inner)
        elif isinstance(node, list):
            for inner in node:
                walk(inner)

    walk(schema)
    return fields, values


def keys_of(value: Any) -> Iterator[str]:
    """Every key of a message, at any depth."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield key
            yield from keys_of(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from keys_of(inner)


def assert_stream(events: list[dict[str, Any]], kinds: dict[str, int], gaps: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Each message as JavaScript reads it: the documented topic, UTF-8, standard JSON, valid in ajv,
    its *_ms copies within half a microsecond of the exact *_ns, seq rising with at most ``gaps`` gaps
    per topic, every field the docs name for its topic present. Returns the messages by kind."""
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_topic: dict[str, list[int]] = defaultdict(list)
    for event in (e for e in events if e["event"] == "message"):
        assert event["frames"] == 2 and event["utf8"] and event["json"], event
        kind, doc = event["kind"], event["message"]
        assert event["topic"] == f"{PREFIX}/{kind}/{doc['camera_id']}", event["topic"]
        assert event["schema_errors"] == [], (kind, event["schema_errors"])
        assert {twin["field"] for twin in event["twins"]} == {"time_ns" if kind == "status" else "capture_time_ns"}
        for twin in event["twins"]:
            assert twin["twin_present"] and twin["ms_type"] == "number", (kind, twin)
            assert abs(twin["diff_ns"]) <= MS_TWIN_NS, (kind, twin)
        by_kind[kind].append(doc)
        by_topic[event["topic"]].append(doc["seq"])
    assert {kind: len(by_kind[kind]) >= want for kind, want in kinds.items()} == dict.fromkeys(kinds, True), dict(by_kind)
    for topic, seqs in by_topic.items():
        steps = [b - a for a, b in itertools.pairwise(seqs)]
        assert all(step >= 1 for step in steps) and sum(step > 1 for step in steps) <= gaps, (topic, seqs)
    schema = json.loads(SCHEMA.read_text())
    fields, values = schema_names(schema)
    settings = schema_names(Settings.model_json_schema())[0]  # the text also names settings (`ng_classes`)
    for kind, docs in by_kind.items():
        named = documented_fields(kind, {doc["task"] for doc in docs if "task" in doc})
        unknown = named - fields - values - settings - NOT_CONFIGURED.keys()
        assert not unknown, f"docs/outputs.md names {sorted(unknown)} for {kind}, which the schema does not have"
        unpaired = {name for name in named if name.endswith("_ns") and name.removesuffix("_ns") + "_ms" not in named}
        assert not unpaired, (
            f"docs/outputs.md names {sorted(unpaired)} for {kind} without the _ms copy to read in JavaScript"
        )
        sent = {key for doc in docs for key in keys_of(doc)}
        missing = (named & fields) - sent - NOT_CONFIGURED.keys()
        if not any(doc.get("detections") for doc in docs):  # a classifier's: the docs say it is empty
            missing -= set(schema["$defs"]["Detection"]["properties"])
        if kind == "verdict" and not any(doc.get("task") == "classify" for doc in by_kind["detections"]):
            missing.discard("top")  # the docs say a classification model's verdict has it
        assert not missing, f"{kind} messages lack {sorted(missing)}, which docs/outputs.md names"
    return by_kind


def documented_subscriber(folder: Path, endpoint: str, server_key: Path, client_key: Path) -> list[str]:
    """The first lines docs/outputs.md's JavaScript subscriber prints, run as it stands on the publisher's
    ``server.key`` and a subscriber's ``line3.key_secret`` (only the endpoint put in)."""
    text = DOCS.read_text()
    section = text[text.index("\n## Securing the stream\n") :]
    section = section[: section.index("\n## ", 1)]
    code = re.search(r"^```js\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert code is not None and "tcp://board:5556" in code.group(1), "docs/outputs.md shows no JavaScript subscriber"
    folder.mkdir()
    shutil.copy(server_key, folder / "server.key")
    shutil.copy(client_key, folder / "line3.key_secret")
    (folder / "subscriber.cjs").write_text(code.group(1).replace("tcp://board:5556", endpoint))
    proc = subprocess.Popen(
        [node("zeromq", "ajv", "ajv-formats"), "subscriber.cjs"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NODE_PATH": str(NODE_MODULES)},
    )
    stuck = threading.Timer(20, proc.kill)  # a client that hears nothing would wait forever
    stuck.start()
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(2)]  # it runs until killed; edged sends 10 a second
    finally:
        stuck.cancel()
        proc.kill()
        _, errors = proc.communicate()
    assert all(lines), errors
    return lines


def test_a_segmentation_models_stream_reads_in_javascript_as_the_docs_say(tmp_path: Path) -> None:
    """Two cameras, one id the start of the other's: a subscriber to one camera's documented topics
    gets the other's too (ZeroMQ matches prefixes), as the docs warn, each topic numbered apart."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    images_config(tmp_path, TASKS / "seg.onnx", [TASKS / "tall.png"], endpoint)  # the model and frames beside it
    source = {"type": "images", "path": "frames", "loop": True, "fps": 10}
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": [{**source, "camera_id": camera} for camera in ("cam1", "cam10")],
            "model": {"path": "seg.onnx"},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
            "thermal": {"enabled": True},
            "inspect": {"mm_per_px": 0.5},
        },
    )
    want = {"detections": 6, "verdict": 6, "status": 4}
    subscriptions = [f"{PREFIX}/{kind}/cam1" for kind in want]
    with daemon(config):
        events = read_stream(endpoint=endpoint, subscriptions=subscriptions, want=want)
        by_kind = assert_stream(events, want)
    assert {doc["camera_id"] for docs in by_kind.values() for doc in docs} == {"cam1", "cam10"}
    assert "subscribing to `edged/detections/cam1` also gets `edged/detections/cam10`'s messages" in " ".join(
        DOCS.read_text().split()
    )
    detection = by_kind["detections"][0]["detections"][0]
    assert by_kind["detections"][0]["task"] == "segment" and detection["polygon"] and detection["area_mm2"] > 0
    assert by_kind["verdict"][0]["verdict"] == "ng" and by_kind["verdict"][0]["source_file"] == "tall.png"


def test_a_classification_models_stream_reads_in_javascript_as_the_docs_say(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(
        tmp_path,
        TASKS / "cls.onnx",
        [TASKS / "square.png", TASKS / "wide.png"],
        endpoint,
        model={"top_k": 3},
        inspect={"ng_classes": ["crack"], "min_confidence": 0.5},
        thermal={"enabled": True},
    )
    want = {"detections": 4, "verdict": 4, "status": 2}
    with daemon(config):
        events = read_stream(endpoint=endpoint, subscriptions=[f"{PREFIX}/"], want=want)
        by_kind = assert_stream(events, want)
    assert {doc["task"] for doc in by_kind["detections"]} == {"classify"}
    assert all(len(doc["top"]) == 3 for doc in by_kind["detections"])
    assert {doc["verdict"] for doc in by_kind["verdict"]} == {"ng", "uncertain"}
    assert all(len(doc["top"]) == 3 for doc in by_kind["verdict"])


def test_over_curve_keys_from_edged_keygen_load_in_zeromq_js_and_only_allowed_ones_get_messages(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    for args in (["keygen", str(keys)], ["keygen", str(tmp_path / "line3"), "--name", "line3"]):
        made = run_cli(*args)
        assert made.returncode == 0, made.stderr
    assert run_cli("keygen", str(tmp_path / "other"), "--name", "other").returncode == 0
    shutil.copy(tmp_path / "line3" / "line3.key", keys / "clients" / "line3.key")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publish = {"curve_server_key": str(keys / "server.key_secret"), "curve_clients_dir": str(keys / "clients")}
    config = images_config(
        tmp_path,
        TASKS / "seg.onnx",
        [TASKS / "tall.png"],
        endpoint,
        inspect={"mm_per_px": 0.5},
        publish=publish,
        thermal={"enabled": True},
    )
    want = {"detections": 3, "verdict": 3, "status": 1}
    with daemon(config):
        events = read_stream(
            endpoint=endpoint,
            subscriptions=[f"{PREFIX}/"],
            want=want,
            server_key=str(keys / "server.key"),
            client_key=str(tmp_path / "line3" / "line3.key_secret"),
            refused_key=str(tmp_path / "other" / "other.key_secret"),
            plaintext=True,
        )
        shown = documented_subscriber(
            tmp_path / "js", endpoint, keys / "server.key", tmp_path / "line3" / "line3.key_secret"
        )
    assert_stream(events, want)
    refusals = {e["client"]: e["type"] for e in events if e["event"] == "refused"}
    assert set(refusals) == {"not allowed", "plaintext"}, refusals
    assert events[-1]["refused_messages"] == 0, events[-1]
    for line in shown:
        topic, seq, verdict, captured = line.split(" ")
        assert (topic, verdict) == (f"{PREFIX}/verdict/{CAMERA}", "ng") and int(seq) >= 0, line
        when = datetime.fromisoformat(captured.replace("Z", "+00:00"))  # JavaScript's toISOString, in UTC
        assert abs(when - datetime.now(timezone.utc)) < timedelta(minutes=1), line


def test_an_anomaly_models_stream_reads_in_javascript_as_the_docs_say(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    anomaly = Path(__file__).parent / "data" / "anomaly"
    config = images_config(
        tmp_path,
        anomaly / "padim.onnx",
        [anomaly / "spot_320x240.png", anomaly / "scratch_640x480.png"],
        endpoint,
        inspect={"mm_per_px": 0.5},
        thermal={"enabled": True},
    )
    want = {"detections": 4, "verdict": 4, "status": 2}
    with daemon(config):
        events = read_stream(endpoint=endpoint, subscriptions=[f"{PREFIX}/"], want=want)
        by_kind = assert_stream(events, want)
    assert {doc["task"] for doc in by_kind["detections"]} == {"anomaly"}
    assert any(doc["regions"] for doc in by_kind["detections"])


def test_a_revoked_key_is_cut_off_while_zeromq_js_subscribers_still_allowed_reconnect_by_themselves(
    tmp_path: Path,
) -> None:
    """docs/outputs.md: on SIGHUP a removed key's subscriber receives nothing more, and every allowed one
    reconnects by itself, the messages sent meanwhile a gap in seq; with libzmq as zeromq.js has it."""
    keys = tmp_path / "keys"
    assert run_cli("keygen", str(keys)).returncode == 0
    for name in ("line3", "line4"):
        assert run_cli("keygen", str(tmp_path / name), "--name", name).returncode == 0
        shutil.copy(tmp_path / name / f"{name}.key", keys / "clients" / f"{name}.key")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publish = {"curve_server_key": str(keys / "server.key_secret"), "curve_clients_dir": str(keys / "clients")}
    config = images_config(
        tmp_path, TASKS / "seg.onnx", [TASKS / "tall.png"], endpoint, inspect={"mm_per_px": 0.5}, publish=publish
    )
    want = {"detections": 3, "verdict": 3}

    def revoke() -> None:
        (keys / "clients" / "line4.key").unlink()
        running.proc.send_signal(signal.SIGHUP)

    with daemon(config) as running:
        events = read_stream(
            on={"receiving": revoke},
            endpoint=endpoint,
            subscriptions=[f"{PREFIX}/detections/", f"{PREFIX}/verdict/"],
            want=want,
            server_key=str(keys / "server.key"),
            client_key=str(tmp_path / "line3" / "line3.key_secret"),
            revoked_key=str(tmp_path / "line4" / "line4.key_secret"),
        )
    assert [e["client"] for e in events if e["event"] == "refused"] == ["revoked"]
    assert events[-1]["revoked_after"] == 0, events[-1]
    after = events[[e["event"] for e in events].index("refused") :]
    assert_stream(after, want, gaps=1)


def test_a_restarted_edged_numbers_from_0_again_and_zeromq_js_subscribers_reconnect_by_themselves(
    tmp_path: Path,
) -> None:
    """A dashboard left running across `systemctl restart edged`: zeromq.js reconnects by itself, and
    ``seq`` starts again from 0, which docs/outputs.md says is a restart, not a loss."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = images_config(
        tmp_path, TASKS / "seg.onnx", [TASKS / "tall.png"], endpoint, source={"fps": 20}, inspect={"mm_per_px": 0.5}
    )
    want = {"detections": 3}
    with daemon(config) as running:
        events = read_stream(
            on={"receiving": running.restart},
            endpoint=endpoint,
            subscriptions=[f"{PREFIX}/detections/"],
            want=want,
            restart_after=10,
        )
    [restarted] = [e for e in events if e["event"] == "restarted"]
    assert restarted["seq"] < restarted["last"], restarted
    assert_stream(events[events.index(restarted) :], want)
    assert "a `seq` lower than the one before on its topic means edged started again" in " ".join(DOCS.read_text().split())
