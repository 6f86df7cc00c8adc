"""A fault on one camera of several, with every output on: the real `edged run` on a video file, a
second video, an image folder and generated scenes, read over ZeroMQ, a real Mosquitto, pymodbus'
Modbus client and asyncua's OPC UA client; and the OPC UA server's side of it (its line of changes,
a reload's replacement of it) against asyncua's client."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cv2
import numpy as np
import pytest
from asyncua import Client, ua
from daemon import RunningDaemon, free_port, write_config, write_video
from mosquitto import Broker, Listener
from onnx_models import colour_probe
from pydantic import ValidationError
from pymodbus.client import ModbusTcpClient
from waiting import wait_for

from edged import opcua
from edged.config import Settings
from edged.messages import DetectionsMessage, VerdictMessage
from edged.modbus import BLOCK
from edged.opcua import OpcuaOutput
from edged.opcua_server import VARIABLES, Change, UaServer

pytestmark = pytest.mark.integration

RED, BLUE = (0, 0, 255), (255, 0, 0)
# Modbus registers of a camera's block (docs/outputs.md, Modbus TCP)
STATE, VERDICT, SEQ = 1, 2, 3
RUNNING, CAMERA_LOST = 1, 2
OK, NG = 1, 2


# ---- the running daemon ---------------------------------------------------------------------


def clip() -> dict[str, Any]:  # red and blue in turn: NG and OK in turn
    return {"type": "file", "camera_id": "line.1-a", "path": "clip.avi", "loop": True, "realtime": True}


def blue() -> dict[str, Any]:  # an id that differs from the first only by case: always OK
    return {"type": "file", "camera_id": "Line.1-A", "path": "blue.avi", "loop": True, "realtime": True}


def stills() -> dict[str, Any]:
    return {"type": "images", "camera_id": "stills", "path": "imgs", "fps": 5.0}


def scenes() -> dict[str, Any]:  # slower than the videos
    return {"type": "synthetic", "camera_id": "syn", "fps": 4.0, "width": 320, "height": 240}


class Board:
    """Four cameras of three kinds on the colour probe, with ZeroMQ, MQTT, Modbus, OPC UA, the journal,
    evidence and the live view, and a client of each."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        colour_probe(workdir / "probe.onnx")
        write_video(workdir / "clip.avi", [RED, BLUE] * 10, size=(128, 96))
        write_video(workdir / "blue.avi", [BLUE] * 10, size=(160, 120))
        write_video(workdir / "red-wide.avi", [RED] * 10, size=(320, 180))
        (workdir / "imgs").mkdir()
        for i, colour in enumerate([RED, BLUE, RED]):
            cv2.imwrite(str(workdir / "imgs" / f"{i:03d}.png"), np.full((150, 200, 3), colour, np.uint8))
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.modbus, self.opcua = free_port(), free_port()
        self.broker = Broker(workdir, free_port())
        self.daemon: RunningDaemon | None = None

    def configure(self, sources: list[dict[str, Any]]) -> Path:
        return write_config(
            self.dir / "edged.toml",
            {
                "source": sources,
                "model": {"path": "probe.onnx"},
                "publish": {"endpoints": [self.endpoint], "status_interval_s": 0.3},
                "thermal": {"enabled": False},
                "service": {"stall_timeout_s": 3.0},
                "http": {"listen": f"127.0.0.1:{free_port()}"},
                "inspect": {"ng_classes": ["red"]},
                "mqtt": {"url": f"mqtt://127.0.0.1:{self.broker.port}", "topic_prefix": "line"},
                "modbus": {"listen": f"127.0.0.1:{self.modbus}"},
                "opcua": {"listen": f"opc.tcp://127.0.0.1:{self.opcua}"},
                "journal": {"path": "journal.sqlite"},
                "evidence": {"dir": "evidence", "save": "ng", "max_per_minute": 0},
            },
        )

    def start(self, sources: list[dict[str, Any]]) -> RunningDaemon:
        self.daemon = RunningDaemon(self.configure(sources), self.endpoint)
        return self.daemon

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.close()
        self.broker.close()

    def blocks(self, cameras: int) -> list[list[int]]:
        """Every camera's Modbus block, read at once; [] while the server is not there (a reload moves it)."""
        c = ModbusTcpClient("127.0.0.1", port=self.modbus, timeout=5, retries=0)
        try:
            if not c.connect():
                return []
            reply = c.read_holding_registers(0, count=BLOCK * cameras, device_id=1)
            if reply.isError():
                return []
            return [reply.registers[BLOCK * i : BLOCK * (i + 1)] for i in range(cameras)]
        except Exception:
            return []
        finally:
            c.close()

    def nodes(self, cameras: list[str], names: tuple[str, ...] = ("State", "Verdict", "Sequence")) -> dict[str, Any]:
        """Each camera's OPC UA values, or the status code that answered instead; {} while no server serves."""
        return asyncio.run(read_nodes(self.opcua, cameras, names))


async def read_nodes(port: int, cameras: list[str], names: tuple[str, ...]) -> dict[str, Any]:
    try:
        async with Client(f"opc.tcp://127.0.0.1:{port}", timeout=10) as c:
            ns = await c.get_namespace_index("urn:edged")
            got: dict[str, Any] = {}
            for camera in cameras:
                for name in names:
                    try:
                        got[f"{camera}.{name}"] = await c.get_node(f"ns={ns};s={camera}.{name}").read_value()
                    except ua.UaStatusCodeError as e:
                        got[f"{camera}.{name}"] = type(e).__name__
            return got
    except (OSError, TimeoutError, ua.UaError):
        return {}


@pytest.fixture
def board(tmp_path: Path) -> Iterator[Board]:
    b = Board(tmp_path)
    yield b
    b.close()


def verdicts(d: RunningDaemon, per_camera: dict[str, int], timeout: float = 30) -> dict[str, list[VerdictMessage]]:
    """At least ``per_camera[name]`` verdicts of each camera, received in order, each under its own topic's camera."""
    got: dict[str, list[VerdictMessage]] = defaultdict(list)
    for msg in d.messages(timeout):
        if isinstance(msg, VerdictMessage):
            got[msg.camera_id].append(msg)
            if all(len(got[name]) >= n for name, n in per_camera.items()):
                return got
    raise AssertionError(f"got { ({k: len(v) for k, v in got.items()}) } of {per_camera}:\n{d.log()}")


def gapless(msgs: list[VerdictMessage]) -> bool:
    seqs = [m.seq for m in msgs]
    return seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_one_cameras_faults_leave_the_others_and_every_output_names_each_camera_right(board: Board) -> None:
    """The video file of one camera renamed away (lost, said by its status, its Modbus block and its
    OPC UA node while the others' verdicts go on without a gap), put back at another frame size, then
    a reload that removes the image camera and turns the order round: each camera's Modbus block,
    OPC UA nodes, MQTT topics, journal rows and evidence folder hold that camera's verdicts alone,
    and the removed camera's retained MQTT status is gone."""
    d = board.start([clip(), blue(), stills(), scenes()])
    mqtt = Listener(board.broker.port, "line/#")
    try:
        first = verdicts(d, {"line.1-a": 4, "Line.1-A": 4, "stills": 2, "syn": 2})
        assert {v.verdict for v in first["Line.1-A"]} == {"ok"}

        # The file goes: that camera is lost, said per camera, and the others go on.
        (board.dir / "clip.avi").rename(board.dir / "clip.gone")
        d.wait_status(lambda s: s.camera_id == "line.1-a" and s.source_state == "lost")
        during = verdicts(d, {"Line.1-A": 10, "stills": 3, "syn": 3})
        assert not during["line.1-a"] or len(during["line.1-a"]) <= 2, "the lost camera's file is gone"
        for name in ("Line.1-A", "stills", "syn"):
            assert gapless(during[name]), name
        assert {v.verdict for v in during["Line.1-A"]} == {"ok"}
        assert wait_for(lambda: [b[STATE] for b in board.blocks(4)] == [CAMERA_LOST, RUNNING, RUNNING, RUNNING], 20)
        assert wait_for(lambda: board.nodes(["line.1-a", "Line.1-A"], ("State",)) == {
            "line.1-a.State": "lost", "Line.1-A.State": "ok"}, 30)  # fmt: skip
        assert wait_for(
            lambda: any(json.loads(m.payload)["source_state"] == "lost" for m in mqtt.on("line/line.1-a/status")), 10
        )

        # Back, at another size and all red: the camera carries on with NG verdicts of the new frames.
        shutil.copy(board.dir / "red-wide.avi", board.dir / "clip.avi")
        assert any(
            isinstance(m, DetectionsMessage) and m.camera_id == "line.1-a" and m.frame_size == (320, 180)
            for m in d.messages(30)
        ), d.log()
        after = verdicts(d, {"line.1-a": 4, "Line.1-A": 4})
        assert {v.verdict for v in after["line.1-a"][-3:]} == {"ng"}

        # A reload removes the image camera and turns the order round.
        board.configure([scenes(), blue(), clip()])
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "camera stills removed" in d.log() and "reloaded: model" in d.log(), 30), d.log()
        last = verdicts(d, {"Line.1-A": 3, "line.1-a": 3, "syn": 1})

        def blocks_follow_the_new_order() -> bool:
            blocks = board.blocks(3)
            return len(blocks) == 3 and [b[VERDICT] for b in blocks[1:]] == [OK, NG]

        assert wait_for(blocks_follow_the_new_order, 20), board.blocks(3)
        for index, name in ((1, "Line.1-A"), (2, "line.1-a")):
            seq = (board.blocks(3)[index][SEQ] << 16) | board.blocks(3)[index][SEQ + 1]
            assert seq >= last[name][0].seq, (name, seq)  # this camera's count, not another's
        expected = {"syn.State": "ok", "Line.1-A.Verdict": "OK", "line.1-a.Verdict": "NG",
                    "stills.State": "BadNodeIdUnknown"}  # fmt: skip

        def nodes_follow() -> bool:
            got = board.nodes(["syn", "Line.1-A", "line.1-a", "stills"], ("State", "Verdict"))
            return all(got.get(key) == value for key, value in expected.items())

        assert wait_for(nodes_follow, 30), board.nodes(["syn", "Line.1-A", "line.1-a", "stills"], ("State", "Verdict"))

        # A dashboard that connects now sees the board's cameras, not the one removed.
        fresh = Listener(board.broker.port, "line/+/status")
        try:
            for topic in ("line/syn/status", "line/Line.1-A/status", "line/line.1-a/status"):  # in any order
                fresh.wait(topic)
            fresh.wait("line/syn/status", count=2)  # one sent since: every retained message came before it
            retained = {m.topic for m in fresh.messages if m.retain and m.payload}
            assert "line/stills/status" not in retained, retained
        finally:
            fresh.close()
        for m in mqtt.messages:
            if m.payload and not m.topic.endswith("/state"):
                assert json.loads(m.payload)["camera_id"] == m.topic.split("/")[1], m.topic

        assert d.stop(timeout=15) == 0, d.log()
    finally:
        mqtt.close()
        d.close()

    # The journal has every camera's verdicts under its own id, none twice; the evidence folders hold their camera's frames.
    with sqlite3.connect(board.dir / "journal.sqlite") as db:
        rows = db.execute("SELECT camera_id, seq, message FROM entries WHERE kind = 'verdict'").fetchall()
    by_camera: dict[str, list[int]] = defaultdict(list)
    for camera, seq, message in rows:
        assert json.loads(message)["camera_id"] == camera
        by_camera[camera].append(seq)
    assert set(by_camera) == {"line.1-a", "Line.1-A", "stills", "syn"}
    for camera, seqs in by_camera.items():
        assert sorted(seqs) == list(range(len(seqs))), camera
    folders = {p.name for p in (board.dir / "evidence").iterdir() if p.is_dir()}
    assert list((board.dir / "evidence" / "line.1-a").rglob("images/*.jpg"))
    assert not list((board.dir / "evidence" / "Line.1-A").rglob("images/*"))  # never an NG frame of the blue camera
    for folder in folders:
        for saved in (board.dir / "evidence" / folder).rglob("messages/*.json"):
            assert json.loads(saved.read_text())["camera_id"] == folder, saved


# ---- the OPC UA server's side -----------------------------------------------------------------


TRY_LISTEN = opcua.try_listen  # the real one, which a test may put a gate in front of


class Gate:
    """`opcua.try_listen` held shut until `opened`: a server stays starting, its changes queued, as long as a test likes."""

    def __init__(self) -> None:
        self.reached = threading.Event()  # a server is at the gate, its loop held there
        self.opened = threading.Event()

    def __call__(self, listen: str) -> Callable[[], None]:
        self.reached.set()
        assert self.opened.wait(30), "the gate was never opened"
        return TRY_LISTEN(listen)


def test_a_camera_a_reload_adds_back_goes_on_from_its_seq_and_the_journal_has_none_twice(board: Board) -> None:
    """A camera removed by one reload and added back by the next is the same camera of the same run:
    its topics' seq go on from where they were (a lower one means edged started again), and the
    journal, which says verdicts by camera and seq, holds none twice."""
    d = board.start([blue(), scenes()])
    try:
        before = verdicts(d, {"syn": 3, "Line.1-A": 1})["syn"]
        for sources in ([blue()], [blue(), scenes()]):
            done = d.log().count("reloaded: model")
            board.configure(sources)
            d.signal(signal.SIGHUP)
            assert wait_for(lambda done=done: d.log().count("reloaded: model") > done, 30), d.log()
        after = verdicts(d, {"syn": 3})["syn"]
        assert after[0].seq > before[-1].seq and gapless(after), ([v.seq for v in before], [v.seq for v in after])
        assert d.stop(timeout=15) == 0, d.log()
    finally:
        d.close()
    with sqlite3.connect(board.dir / "journal.sqlite") as db:
        twice = db.execute(
            "SELECT camera_id, seq FROM entries WHERE kind = 'verdict' GROUP BY camera_id, seq HAVING count(*) > 1"
        ).fetchall()
    assert not twice, twice


def serving(server: UaServer) -> bool:
    return wait_for(lambda: server.serving, 30)


def verdict_change(camera: str, seq: int) -> Change:
    values = {"Verdict": "OK", "Sequence": seq, "PartId": "", "OkCount": seq + 1, "NgCount": 0,
              "CaptureToVerdictMs": 1.0, "LastMessage": "{}"}  # fmt: skip
    return Change(camera, values, time.time_ns(), time.monotonic_ns())


def settings_of(cameras: list[str], port: int, tmp_path: Path) -> Settings:
    return Settings(
        source=[{"type": "synthetic", "camera_id": name} for name in cameras],
        model={"path": tmp_path / "m.onnx"},
        inspect={},
        opcua={"listen": f"opc.tcp://127.0.0.1:{port}"},
    )


def status_round(out: OpcuaOutput, states: dict[str, str]) -> None:
    """A status round of cameras in ``states`` (only what the output reads of each status message)."""
    out.status([SimpleNamespace(message=SimpleNamespace(camera_id=c, source_state=s)) for c, s in states.items()])  # type: ignore[misc]


def test_a_flood_of_one_cameras_verdicts_while_the_server_starts_leaves_the_others_last_verdict_and_every_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's line holds 64 changes: one camera's verdicts flooding in while it starts (seconds
    on a board) dropped another camera's last verdict and every camera's state, each written once:
    the status rounds write them again once the line has dropped changes."""
    gate = Gate()
    monkeypatch.setattr(opcua, "try_listen", gate)
    port = free_port()
    out = OpcuaOutput._made(settings_of(["busy", "quiet"], port, tmp_path))
    assert out is not None
    try:
        status_round(out, {"busy": "ok", "quiet": "lost"})
        out._put_verdict(verdict_change("quiet", 41))
        for seq in range(300):  # far more than the line holds
            out._put_verdict(verdict_change("busy", seq))
        assert out.server.dropped > 0 and not out.server.serving
        gate.opened.set()
        assert serving(out.server)
        status_round(out, {"busy": "ok", "quiet": "lost"})  # no camera's state changed since
        names = ("State", "Verdict", "Sequence")
        expected = {"busy.State": "ok", "busy.Verdict": "OK", "busy.Sequence": 299,
                    "quiet.State": "lost", "quiet.Verdict": "OK", "quiet.Sequence": 41}  # fmt: skip
        assert wait_for(lambda: asyncio.run(read_nodes(port, ["busy", "quiet"], names)) == expected, 20), asyncio.run(
            read_nodes(port, ["busy", "quiet"], names)
        )
    finally:
        gate.opened.set()
        out.close()


def test_a_reload_that_replaces_the_opcua_server_never_waits_for_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frame loop reloads the outputs: a server still starting (asyncua takes seconds on a board),
    or stopping, held every camera's frames as long. The replacement now waits for it on its own
    thread, and serves the new cameras, with the counts and states carried on, once it has gone."""
    gate = Gate()
    monkeypatch.setattr(opcua, "try_listen", gate)
    port = free_port()
    old = OpcuaOutput._made(settings_of(["a", "b"], port, tmp_path))
    assert old is not None
    old.server.put(Change("a", {"State": "ok"}, time.time_ns()))
    old._states["a"] = "ok"
    assert gate.reached.wait(30)  # starting, and busy: it cannot even hear that it is to stop
    replaced: list[OpcuaOutput | None] = []
    reload = threading.Thread(target=lambda: replaced.append(old.reload(settings_of(["a", "b", "c"], port, tmp_path), None)))  # type: ignore[arg-type]
    reload.start()
    try:
        reload.join(1.0)
        assert not reload.is_alive(), "the reload waited for the server it replaces, which is still starting"
        (new,) = replaced
        assert new is not None and new is not old and not new.server.serving
    finally:
        gate.opened.set()
        reload.join(40)
    try:
        assert serving(new.server)
        assert wait_for(lambda: not old.server._thread.is_alive(), 10)
        assert wait_for(
            lambda: asyncio.run(read_nodes(port, ["a", "c"], ("State",))) == {"a.State": "ok", "c.State": "starting"}, 20
        )
    finally:
        new.close()
        old.close()


def test_camera_ids_that_are_the_node_ids_of_others_are_refused_with_opcua(tmp_path: Path) -> None:
    """``Objects/edged`` is ``s=edged`` and camera top's Verdict ``s=top.Verdict``: a camera of either
    id made the server fail to build, and no camera was served."""
    for clash, said in (
        (["edged", "top"], "camera_id 'edged' is the node id of Objects/edged/"),
        (["top", "top.Verdict"], "camera_id 'top.Verdict' is the node id of camera top's Verdict"),
        (["top", "top.Trigger"], "camera_id 'top.Trigger' is the node id of camera top's Trigger"),
    ):
        with pytest.raises(ValidationError, match=said):
            settings_of(clash, free_port(), tmp_path)
    # Without [opcua], or where the part before the dot is no camera, or the part after no node, all is well.
    Settings(
        source=[{"type": "synthetic", "camera_id": name} for name in ("edged", "top.Verdict")],
        model={"path": tmp_path / "m.onnx"},
    )
    settings_of(["top", "line.Verdict", "top.verdict", "Edged"], free_port(), tmp_path)
    from edged.settings.opcua import NODE_NAMES, ROOT  # the names the check knows are the server's

    assert set(NODE_NAMES) == set(VARIABLES) | {"Trigger"} and ROOT == "edged"
