"""A running daemon reloaded from a model of one task to a model of another (detect, classify, anomaly,
segment, in several orders), every output on and a real client of each connected throughout: a
ZeroMQ subscriber, `mosquitto_sub` on Mosquitto, a pymodbus poller of the verdict block, an asyncua
subscriber to the camera's variables, an MJPEG viewer and the pages beside it, the journal, evidence
and a reject line (the fake gpiod). Each output must follow the model serving, with nothing left of
the one before, and a reload whose ``[inspect]`` does not fit its model's task is refused while every
output goes on serving."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from asyncua import Client
from daemon import RunningDaemon, free_port, rss_kb, run_cli, write_config
from mosquitto import Broker
from pymodbus.client import ModbusTcpClient
from waiting import wait_for

from edged.messages import DetectionsMessage, StatusMessage, VerdictMessage, parse_message
from edged.modbus import NG_CLASS, NO_CLASS, SEQ, VERDICT, VERDICT_WORDS
from edged.opcua import VERDICTS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "tasks"
ANOMALY = ROOT / "tests" / "data" / "anomaly"
FAKES = Path(__file__).parent / "fakes"
CHIP = "/dev/gpiochip0"
WAIT_S = 60.0  # generous: both cores may be busy with other tests
# Each task's model and an [inspect] it takes; and one it refuses, a key of another task.
MODELS: dict[str, tuple[Path, dict[str, Any]]] = {
    "detect": (ROOT / "models" / "demo.onnx", {}),
    "classify": (TASKS / "cls.onnx", {"ng_classes": ["crack"], "min_confidence": 0.5}),
    "anomaly": (ANOMALY / "padim.onnx", {}),
    "segment": (TASKS / "seg.onnx", {"mm_per_px": 0.5}),
}
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "classify": ({"ng_classes": ["crack"], "zones": {"belt": [[0, 0], [1, 0], [1, 1]]}}, "inspect.zones: a classification"),
    "anomaly": ({"ng_classes": ["scratch"]}, "inspect.ng_classes is for detection models"),
    "segment": ({"roi": [0, 0, 100, 100]}, "inspect.roi is for classification models"),
    "detect": ({"min_confidence": 0.5}, "inspect.min_confidence is for classification models"),
}
IMAGES = (TASKS / "wide.png", TASKS / "square.png", TASKS / "tall.png", ANOMALY / "spot_320x240.png")


class Line:
    """Mosquitto, the daemon on ``task``'s model with every output on, and its configuration to rewrite."""

    def __init__(self, tmp_path: Path, task: str) -> None:
        self.tmp = tmp_path
        (tmp_path / "frames").mkdir()
        for image in IMAGES:
            shutil.copy(image, tmp_path / "frames" / image.name)
        self.record = tmp_path / "gpio.record"
        chips = {"chips": {CHIP: {"label": "pinctrl-test", "lines": ["EJECT"]}}, "record": str(self.record)}
        (tmp_path / "gpio.json").write_text(json.dumps(chips))
        env = {
            "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
            "FAKE_GPIOD": str(tmp_path / "gpio.json"),
        }
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.mqtt_port, self.modbus_port, self.opcua_port, self.http_port = (free_port() for _ in range(4))
        self.journal = tmp_path / "journal.sqlite"
        self.broker = Broker(tmp_path, self.mqtt_port)
        try:
            self.daemon = RunningDaemon(self.configure(task), self.endpoint, env)
        except BaseException:
            self.broker.close()
            raise

    def configure(self, task: str, inspect: dict[str, Any] | None = None) -> Path:
        model, taken = MODELS[task]
        doc: dict[str, Any] = {
            "source": {"type": "images", "path": str(self.tmp / "frames"), "loop": True, "fps": 10.0},
            "model": {"path": str(model)},
            "inspect": taken if inspect is None else inspect,
            "publish": {"endpoints": [self.endpoint], "status_interval_s": 0.25},
            "thermal": {"enabled": False},
            "journal": {"path": str(self.journal), "detections": True},
            "evidence": {"dir": str(self.tmp / "evidence"), "save": "all", "max_per_minute": 0},
            "mqtt": {"url": f"mqtt://127.0.0.1:{self.mqtt_port}", "publish_empty": True},
            "modbus": {"listen": f"127.0.0.1:{self.modbus_port}"},
            "opcua": {"listen": f"opc.tcp://127.0.0.1:{self.opcua_port}"},
            "http": {"listen": f"127.0.0.1:{self.http_port}", "view_fps": 10.0},
            "reject": {"chip": CHIP, "line": "EJECT", "delay_ms": 300.0, "pulse_ms": 5.0},
        }
        return write_config(self.tmp / "edged.toml", doc)

    def reload(self, task: str, inspect: dict[str, Any] | None = None) -> None:
        """SIGHUP to ``task``'s model, once it is loaded and tried: "reloaded", or, refused, "reload refused"."""
        said = "reload refused" if inspect is not None else "reloaded:"
        before = self.daemon.log().count(said)
        self.configure(task, inspect)
        self.daemon.signal(signal.SIGHUP)
        assert wait_for(lambda: self.daemon.log().count(said) > before, WAIT_S), self.daemon.log()[-4000:]

    def page(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=WAIT_S) as answer:
            assert answer.status == 200, path
            return bytes(answer.read())

    def pulses(self) -> tuple[int, int]:
        """The reject line's rising edges, and how often it was released."""
        levels = [row.split()[-1] for row in self.record.read_text().splitlines()] if self.record.exists() else []
        return sum(a != "1" and b == "1" for a, b in itertools.pairwise(["0", *levels])), levels.count("released")

    def close(self) -> None:
        try:
            self.daemon.close()
        finally:
            self.broker.close()


class Clients:
    """A client of each output, attached until `leave`, recording what it is served."""

    def __init__(self, line: Line) -> None:
        self.line = line
        self.done = threading.Event()
        self.errors: list[str] = []
        self.modbus: list[list[int]] = []  # every read of the verdict block
        self.opcua: list[tuple[str, Any]] = []  # (variable, value) of every data change
        self.jpegs = 0  # JPEGs received on one stream connection
        self.mqtt_out = (line.tmp / "mqtt.txt").open("w")
        self.mqtt = subprocess.Popen(
            ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(line.mqtt_port), "-t", "#", "-v", "-q", "1"],
            stdout=self.mqtt_out,
            stderr=subprocess.STDOUT,
        )
        self.threads = [
            threading.Thread(target=self._poll_modbus, daemon=True),
            threading.Thread(target=lambda: asyncio.run(self._subscribe_opcua()), daemon=True),
            threading.Thread(target=self._view, daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _poll_modbus(self) -> None:
        client = ModbusTcpClient("127.0.0.1", port=self.line.modbus_port, timeout=10, retries=0)
        try:
            assert wait_for(client.connect, WAIT_S), "no Modbus server"
            while not self.done.wait(0.05):
                read = client.read_holding_registers(0, count=16, device_id=1)
                if read.isError():
                    self.errors.append(f"modbus: {read}")
                else:
                    self.modbus.append(list(read.registers))
        except Exception as e:  # said by the test
            self.errors.append(f"modbus: {e!r}")
        finally:
            client.close()

    async def _subscribe_opcua(self) -> None:
        clients = self

        class Handler:
            def datachange_notification(self, node: Any, val: Any, data: Any) -> None:
                clients.opcua.append((str(node.nodeid.Identifier), val))

        try:
            assert await asyncio.to_thread(wait_for, lambda: "OPC UA: serving" in self.line.daemon.log(), WAIT_S)
            async with Client(f"opc.tcp://127.0.0.1:{self.line.opcua_port}", timeout=WAIT_S) as client:
                ns = await client.get_namespace_index("urn:edged")
                camera = await client.nodes.objects.get_child([f"{ns}:edged", f"{ns}:cam0"])
                subscription = await client.create_subscription(20, Handler())
                names = ("Verdict", "Sequence", "LastMessage")
                await subscription.subscribe_data_change(
                    [await camera.get_child(f"{ns}:{name}") for name in names], queuesize=100
                )
                while not await asyncio.to_thread(self.done.wait, 0.2):
                    pass
                await subscription.delete()
        except Exception as e:  # said by the test
            self.errors.append(f"opcua: {e!r}")

    def _view(self) -> None:
        try:
            viewer = http.client.HTTPConnection("127.0.0.1", self.line.http_port, timeout=WAIT_S)
            viewer.request("GET", "/stream.mjpg")
            stream = viewer.getresponse()
            assert stream.status == 200
            while not self.done.is_set():
                line = stream.readline()
                assert line, "the MJPEG stream ended"
                self.jpegs += line.startswith(b"Content-Type: image/jpeg")
            viewer.close()
        except Exception as e:  # said by the test
            self.errors.append(f"view: {e!r}")

    def leave(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(WAIT_S)
        self.mqtt.terminate()
        self.mqtt.wait(10)
        self.mqtt_out.close()


@pytest.fixture
def line(tmp_path: Path) -> Iterator[Line]:
    running = Line(tmp_path, "detect")
    try:
        yield running
    finally:
        running.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def held(msg: DetectionsMessage) -> tuple[bool, bool, bool]:
    """Which task's fields a detections message holds: a classifier's classes, an anomaly model's score
    and regions, an instance's outline."""
    outlines = any(d.polygon is not None for d in msg.detections)
    return msg.top is not None, msg.anomaly_score is not None and msg.regions is not None, outlines


def held_by(task: str) -> tuple[bool, bool, bool]:
    # Each of the test's images shows a segmentation model something (its instances' outlines).
    return task == "classify", task == "anomaly", task == "segment"


def served(line: Line, task: str, seen: dict[int, VerdictMessage], count: int = 3) -> list[DetectionsMessage]:
    """``count`` detections messages of ``task``'s model and their verdicts, of frames captured from now
    on; every verdict read meanwhile goes into ``seen``, by seq."""
    since = time.time_ns()
    frames: list[DetectionsMessage] = []
    for msg in line.daemon.messages(WAIT_S):
        if isinstance(msg, VerdictMessage):
            seen[msg.seq] = msg
        elif isinstance(msg, DetectionsMessage) and msg.capture_time_ns > since:
            assert (msg.task, *held(msg)) == (task, *held_by(task)), (task, msg.source_file, held(msg))
            frames.append(msg)
        if len(frames) >= count and all(any(v.frame_id == f.frame_id for v in seen.values()) for f in frames):
            return frames
    raise AssertionError(f"only {len(frames)} {task} frame(s) with verdicts in {WAIT_S} s:\n{line.daemon.log()[-4000:]}")


def the_pages_serve(line: Line, clients: Clients, task: str) -> None:
    """The view goes on on its connection; the pages answer, naming the model serving."""
    jpegs = clients.jpegs
    assert wait_for(lambda: clients.jpegs > jpegs, WAIT_S), clients.errors
    digest = sha256(MODELS[task][0])  # as fresh as the status: its next round names the model
    assert wait_for(lambda: json.loads(line.page("/status.json"))["model"]["sha256"] == digest, WAIT_S)
    assert wait_for(lambda: f'model_sha256="{digest}"' in line.page("/metrics").decode(), WAIT_S)
    for path in ("/", "/verdicts.json", "/cameras.json", "/history.json?limit=1000", "/snapshot.jpg"):
        line.page(path)


def test_every_output_follows_reloads_across_the_four_tasks_and_a_refused_one_leaves_them_serving(line: Line) -> None:
    seen: dict[int, VerdictMessage] = {}
    served(line, "detect", seen)
    clients = Clients(line)
    try:
        order = ["detect", "classify", "anomaly", "segment", "detect", "anomaly", "classify", "segment", "detect"]
        rss: list[int] = []
        for running, task in itertools.pairwise(order):
            # Refused: the running model and every output go on.
            inspect, words = REFUSED[task]
            said = line.daemon.log().count(words)
            line.reload(task, inspect)
            assert line.daemon.log().count(words) > said
            served(line, running, seen, 2)
            the_pages_serve(line, clients, running)
            line.reload(task)
            served(line, task, seen)
            the_pages_serve(line, clients, task)
            rss.append(rss_kb(line.daemon.proc.pid))
        assert not clients.errors, clients.errors
    finally:
        clients.leave()
    assert line.daemon.stop(15) == 0, line.daemon.log()[-4000:]
    log = line.daemon.log_path.read_text()
    assert "Traceback" not in log and "CRITICAL" not in log
    # Memory: a second round of the four tasks holds what the first made (each model's buffers, once).
    assert rss[-1] - rss[3] < 40_000, rss
    # Modbus: every read of a verdict is that verdict's, as ZeroMQ sent it: its word, and its NG class.
    read = 0
    for block in clients.modbus:
        verdict = seen.get((block[SEQ] << 16) | block[SEQ + 1])
        if block[VERDICT] and verdict is not None:
            ng_class = verdict.reasons[0].class_id if verdict.verdict == "ng" and verdict.reasons else NO_CLASS
            assert (block[VERDICT], block[NG_CLASS]) == (VERDICT_WORDS[verdict.verdict], ng_class), (block, verdict)
            read += 1
    assert read > len(order)
    # OPC UA: each LastMessage is the verdict message of its seq as sent; Verdict a string, Sequence a number.
    messages = [parse_message(value.encode()) for node, value in clients.opcua if node.endswith("LastMessage")]
    assert len(messages) > len(order) and all(isinstance(m, VerdictMessage) for m in messages)
    assert all(m == seen[m.seq] for m in messages if isinstance(m, VerdictMessage) and m.seq in seen)
    assert {value for node, value in clients.opcua if node.endswith(".Verdict")} <= set(VERDICTS.values())
    assert all(isinstance(value, int) for node, value in clients.opcua if node.endswith("Sequence"))
    # MQTT: every message of every task parses and meets the schema; the verdicts are ZeroMQ's.
    schema = json.loads(subprocess.run([sys.executable, "-m", "edged", "schema"], capture_output=True, check=True).stdout)
    validator = jsonschema.Draft202012Validator(schema)
    tasks = set()
    merged: int | None = None  # pulses merged into the one before, as the status last counted them (at the stop)
    for row in (line.tmp / "mqtt.txt").read_text().splitlines():
        topic, _, payload = row.partition(" ")
        if payload.startswith("{"):
            validator.validate(json.loads(payload))
            msg = parse_message(payload.encode())
            merged = msg.reject.merged if isinstance(msg, StatusMessage) and msg.reject is not None else merged
            tasks |= {msg.task} if isinstance(msg, DetectionsMessage) else set()
            if isinstance(msg, VerdictMessage) and msg.seq in seen:
                assert msg.model_dump(exclude={"replayed"}) == seen[msg.seq].model_dump(exclude={"replayed"}), topic
    assert tasks == set(MODELS)
    # The journal holds the rows of four models: `edged history` reads them all, in every format.
    for fmt in ([], ["--json"], ["--csv"]):
        result = run_cli("history", "--journal", str(line.journal), "--limit", "100000", *fmt)
        assert result.returncode == 0 and "unreadable" not in result.stdout + result.stderr, result.stderr
    rows = json.loads(run_cli("history", "--journal", str(line.journal), "--limit", "100000", "--json").stdout)
    assert {row["model_sha256"] for row in rows} == {sha256(model) for model, _ in MODELS.values()}
    assert all(parse_message(json.dumps(row["message"]).encode()) for row in rows)
    # Evidence: a dataset per model, each holding its own task's frames alone.
    datasets = sorted((line.tmp / "evidence").iterdir())
    assert len(datasets) == 4, datasets
    for dataset in datasets:
        task = json.loads((dataset / "dataset.json").read_text())["task"]
        saved = {DetectionsMessage.model_validate_json(p.read_bytes()).task for p in dataset.rglob("messages/*.json")}
        assert saved == {task}, (dataset.name, saved)
    # The reject line: requested once for all the reloads, a pulse for every NG or uncertain part of every task,
    # one part's merged into the pulse before where the machine held the line's process back until they overlapped.
    ng = sum(row["verdict"] in ("ng", "uncertain") for row in rows if row["kind"] == "verdict")
    pulses, released = line.pulses()
    assert merged is not None and released == 1 and pulses + merged >= ng > 0, (pulses, merged, ng)


@pytest.mark.parametrize("mode", ["free", "request"])
def test_frames_a_reload_cannot_take_are_inspected_by_the_running_model_until_one_it_can_comes(
    tmp_path: Path, mode: str
) -> None:
    # A detector on a folder of 320x240 and 200x200 images, reloaded to a classifier whose region fits
    # neither. Before, every frame went to the reload's trial and was rejected there: for as long as no
    # image fitted, the running model published nothing, answered no request, and the reject line saw no part.
    (tmp_path / "frames").mkdir()
    for image in (TASKS / "wide.png", TASKS / "square.png"):
        shutil.copy(image, tmp_path / "frames" / image.name)
    endpoint, trigger = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))

    def configure(task: str, inspect: dict[str, Any]) -> Path:
        source = {"type": "images", "path": str(tmp_path / "frames"), "loop": True, "fps": 10.0, "trigger": mode}
        sections = {"source": source, "model": {"path": str(MODELS[task][0])}, "inspect": inspect}
        sections |= {"publish": {"endpoints": [endpoint]}, "trigger": {"endpoint": trigger, "timeout_s": 10.0}}
        return write_config(tmp_path / "edged.toml", sections | {"thermal": {"enabled": False}})

    def answer(part_id: str) -> VerdictMessage:
        asked = run_cli("trigger", trigger, "--part-id", part_id, "--json", "--timeout", str(WAIT_S))
        assert asked.stdout.strip(), asked.stderr  # no verdict (timed out): said on stderr alone
        reply = parse_message(asked.stdout.encode())
        assert isinstance(reply, VerdictMessage) and reply.part_id == part_id, asked.stdout + asked.stderr
        return reply

    d = RunningDaemon(configure("detect", {}), endpoint)
    try:
        assert wait_for(lambda: "first frame processed: ready" in d.log(), WAIT_S), d.log()
        configure("classify", {"ng_classes": ["crack"], "roi": [0, 0, 330, 250]})
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "trying it on the next frame" in d.log(), WAIT_S), d.log()
        if mode == "free":
            waiting = d.captured_after(time.time_ns(), 4)
            assert {(m.task, m.model.sha256) for m in waiting} == {("detect", sha256(MODELS["detect"][0]))}
        else:
            assert answer("waiting").model_sha256 == sha256(MODELS["detect"][0])
        assert "inspect.roi [0, 0, 330, 250] does not fit in a " in d.log()
        assert d.log().count("the reload cannot take frame") == 1  # said once, not at every frame
        # Served by the running model, so not dropped: the status counts no frame as unfit.
        since = time.time_ns()
        status = d.wait_status(lambda s: s.time_ns > since and s.frames_processed > 0)
        assert not status.drops.get("bad_frame_size"), status.drops
        shutil.copy(ANOMALY / "good_1280x720.png", tmp_path / "frames")  # the first image the region fits
        assert wait_for(lambda: "reloaded: model cls@" in d.log(), WAIT_S), d.log()
        if mode == "free":
            taken = next(m for m in d.messages(WAIT_S) if isinstance(m, DetectionsMessage) and m.task == "classify")
            assert taken.source_file == "good_1280x720.png", taken
        else:
            taken_over = answer("switched")
            assert (taken_over.model_sha256, taken_over.source_file) == (sha256(MODELS["classify"][0]), "good_1280x720.png")
    finally:
        d.stop()
