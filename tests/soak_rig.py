"""The real daemon with every output on at once, and the clients of each, for the soaks of the outputs.

`Rig` starts Mosquitto and `edged run` with a free-running camera and a camera in request mode, the
shadow trial, the journal, evidence, the reject line (on the fake gpiod), MQTT, Modbus TCP, OPC UA and
the live view on free loopback ports. `Clients` attaches one client of each (a ZeroMQ SUB, an MQTT
subscriber, a Modbus poller that also triggers by coil, an OPC UA subscriber, an MJPEG viewer, a
ZeroMQ requester), waits until each has been served, and lets them all go. `Usage` reads the daemon's
resident memory, threads and open file descriptors from /proc.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from asyncua import Client
from daemon import RunningDaemon, free_port, rss_kb, write_config
from mosquitto import Broker, Listener
from onnx_models import fixed_scene
from pymodbus.client import ModbusTcpClient
from test_trigger import SCENE, images
from waiting import wait_for

from edged.messages import StatusMessage, VerdictMessage, parse_message
from edged.settings.mqtt import topic_hostname

FAKES = Path(__file__).parent / "fakes"
CHIP = "/dev/gpiochip0"
UNIT = 1
GATE = 1  # the request-mode camera's index: its Modbus block and coil are at 16 * GATE
WAIT_S = 60.0  # generous: both cores may be busy with other tests


@dataclass(frozen=True)
class Usage:
    """What the daemon holds at one moment."""

    rss_kb: int
    threads: int
    fds: Counter[str]  # open descriptors by what they are: a socket, a pipe, an eventfd, a file's path

    @property
    def fd_count(self) -> int:
        return sum(self.fds.values())


def usage(pid: int, transient: tuple[Path, ...] = ()) -> Usage:
    """``pid``'s resident memory, threads and descriptors; files under ``transient`` (opened and closed
    as frames come: the images read, the evidence written) are left out, so that they compare exactly."""
    fds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed since the listing
        if target.startswith("/"):
            if any(target.startswith(f"{folder}/") for folder in transient):
                continue
        else:
            target = target.split(":[")[0] if target.startswith(("socket:", "pipe:")) else target
        fds[target] += 1
    return Usage(rss_kb(pid), len(os.listdir(f"/proc/{pid}/task")), fds)


class Rig:
    """Mosquitto and the daemon with every output on, the fake gpiod's reject lines, in ``tmp_path``.

    ``model`` (an ONNX file) is the live model and the candidate on trial; by default `fixed_scene`'s,
    which finds a crack and a scratch in every frame, so that every verdict is NG (evidence is saved,
    the line pulses). The free-running camera ``line`` runs at ``fps``; ``gate`` takes requests.
    """

    def __init__(self, tmp_path: Path, fps: float, model: Path | None = None, labels: Path | None = None) -> None:
        if model is None:
            model = fixed_scene(tmp_path / "model.onnx", SCENE)
        folder = images(tmp_path / "frames")
        gpio = tmp_path / "gpio.json"
        gpio.write_text(json.dumps({"chips": {CHIP: {"label": "pinctrl-test", "lines": ["EJECT", "GATE"]}}}))
        env = {
            "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
            "FAKE_GPIOD": str(gpio),
        }
        self.endpoint, self.trigger = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        self.mqtt_port, self.modbus_port, self.opcua_port, self.http_port = (free_port() for _ in range(4))
        # read or written and closed as frames come: left out of the descriptors compared
        self.transient = (folder, tmp_path / "evidence", tmp_path / "disagree")
        self.broker = Broker(tmp_path, self.mqtt_port)
        doc: dict[str, Any] = {
            "source": [
                {"type": "images", "path": str(folder), "fps": fps, "camera_id": "line", "trigger": "free"},
                {"type": "images", "path": str(folder), "fps": 10.0, "camera_id": "gate", "reject": {"line": "GATE"}},
            ],
            "model": {"path": str(model), **({"labels": str(labels)} if labels else {})},
            "model.candidate": {
                "path": str(model),
                "sample_every": 5,
                "min_frames": 10**9,  # on trial for the whole run
                "control": f"ipc://{tmp_path}/control.sock",
                "evidence_dir": str(self.transient[2]),
            },
            "publish": {"endpoints": [self.endpoint], "status_interval_s": 0.25},
            "thermal": {"enabled": False},
            "inspect": {},
            "trigger": {"mode": "request", "endpoint": self.trigger, "timeout_s": 10.0},  # a busy machine too
            # small bounds, reached within the warm-up: the soak then runs at them
            "journal": {"path": str(tmp_path / "journal.sqlite"), "detections": True, "max_bytes": 1_000_000},
            "evidence": {
                "dir": str(self.transient[1]),
                "save": "all",
                "max_per_minute": 0,
                "max_bytes": 1_000_000,
                "jpeg_quality": 50,
            },
            "mqtt": {"url": f"mqtt://127.0.0.1:{self.mqtt_port}", "publish_empty": True},
            "modbus": {"listen": f"127.0.0.1:{self.modbus_port}", "unit_id": UNIT},
            "opcua": {"listen": f"opc.tcp://127.0.0.1:{self.opcua_port}"},
            "http": {"listen": f"127.0.0.1:{self.http_port}", "view_fps": 10.0},
            "reject": {"chip": CHIP, "line": "EJECT", "delay_ms": 50.0, "pulse_ms": 5.0},
        }
        try:
            self.daemon = RunningDaemon(write_config(tmp_path / "edged.toml", doc), self.endpoint, env)
        except BaseException:
            self.broker.close()
            raise

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.daemon.close()
        finally:
            self.broker.close()

    @property
    def pid(self) -> int:
        return self.daemon.proc.pid

    def usage(self) -> Usage:
        return usage(self.pid, self.transient)

    def status(self, condition: Callable[[StatusMessage], bool]) -> StatusMessage:
        return self.daemon.wait_status(condition, timeout=WAIT_S)

    def wait_serving(self) -> StatusMessage:
        """Every output up: frames inspected on both cameras, MQTT connected, OPC UA serving, the
        candidate on trial."""
        log = self.daemon.log
        assert wait_for(lambda: "Modbus TCP on" in log() and "OPC UA: serving" in log(), WAIT_S), log()
        self.status(lambda s: s.camera_id == "gate" and s.capture is not None and s.capture.frames_captured > 0)
        return self.status(
            lambda s: (
                s.camera_id == "line"
                and s.frames_processed > 0
                and s.mqtt_state == "connected"
                and s.opcua is not None
                and s.opcua.serving
                and s.candidate is not None
                and s.candidate.state == "on_trial"
            )
        )

    def wait_alone(self) -> StatusMessage:
        """The daemon counts no OPC UA or Modbus client any more (they have left)."""
        return self.status(
            lambda s: s.opcua is not None and s.opcua.clients == 0 and s.modbus is not None and s.modbus.clients == 0
        )

    def reload(self) -> None:
        """SIGHUP, and the reload done (logged)."""
        log = self.daemon.log
        done = log().count("reloaded:")
        self.daemon.signal(signal.SIGHUP)
        assert wait_for(lambda: log().count("reloaded:") > done, WAIT_S), log()

    def restart_broker(self) -> None:
        """Mosquitto stopped and started again; back once the daemon has connected again."""
        self.broker.stop()
        self.status(lambda s: s.mqtt_state == "disconnected")
        self.broker.start()
        self.status(lambda s: s.mqtt_state == "connected")


class Clients:
    """One client of each output attached to ``rig``'s daemon until `leave`: each served at least once
    by `served` (ZeroMQ, MQTT, Modbus reads and a coil trigger, OPC UA notifications, the MJPEG stream,
    a ZeroMQ trigger request)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(rig.endpoint)
        self.mqtt = Listener(rig.mqtt_port)
        self.modbus = ModbusTcpClient("127.0.0.1", port=rig.modbus_port, timeout=10, retries=0)
        assert self.modbus.connect()
        self.viewer = http.client.HTTPConnection("127.0.0.1", rig.http_port, timeout=WAIT_S)
        self.viewer.request("GET", "/stream.mjpg?camera=line")
        self.stream = self.viewer.getresponse()
        assert self.stream.status == 200
        self.notifications = 0
        self._opcua_ready = threading.Event()
        self._opcua_done = threading.Event()
        self._opcua_error: BaseException | None = None
        self._opcua = threading.Thread(target=self._opcua_client, name="soak-opcua", daemon=True)
        self._opcua.start()

    def _opcua_client(self) -> None:
        try:
            asyncio.run(self._subscribe())
        except BaseException as e:  # seen by `served`
            self._opcua_error = e
            self._opcua_ready.set()

    async def _subscribe(self) -> None:
        clients = self

        class Handler:
            def datachange_notification(self, node: Any, val: Any, data: Any) -> None:
                clients.notifications += 1
                if clients.notifications >= 3:
                    clients._opcua_ready.set()

        async with Client(f"opc.tcp://127.0.0.1:{self.rig.opcua_port}", timeout=WAIT_S) as c:
            ns = await c.get_namespace_index("urn:edged")
            camera = await c.nodes.objects.get_child([f"{ns}:edged", f"{ns}:line"])
            subscription = await c.create_subscription(50, Handler())
            await subscription.subscribe_data_change([await camera.get_child(f"{ns}:Sequence")])
            while not await asyncio.to_thread(self._opcua_done.wait, 0.2):
                pass
            await subscription.delete()

    def served(self) -> None:
        """Each client has been served: a message on the SUB and on MQTT, Modbus reads and a coil
        trigger answered, OPC UA notifications, two frames of the stream, a trigger request answered.
        Also the pages a browser fetches beside the stream."""
        assert self.sub.poll(int(WAIT_S * 1000)), "no message on the SUB socket"
        self.sub.recv_multipart()
        self.mqtt.wait(f"edged/{topic_hostname()}/line/verdict", timeout_s=WAIT_S)
        assert not self.modbus.read_holding_registers(0, count=16, device_id=UNIT).isError()
        coil = 16 * GATE
        assert not self.modbus.write_coil(coil, True, device_id=UNIT).isError()
        assert wait_for(lambda: not self.modbus.read_coils(coil, count=1, device_id=UNIT).bits[0], WAIT_S)
        frames = 0
        while frames < 2:
            line = self.stream.readline()
            assert line, "the MJPEG stream ended"
            frames += line.startswith(b"Content-Type: image/jpeg")
        for page in ("/status.json", "/metrics", "/verdicts.json", "/snapshot.jpg?camera=gate"):
            with urllib.request.urlopen(f"http://127.0.0.1:{self.rig.http_port}{page}", timeout=WAIT_S) as r:
                r.read()
        requester = self.context.socket(zmq.REQ)
        requester.setsockopt(zmq.LINGER, 0)
        requester.connect(self.rig.trigger)
        requester.send(json.dumps({"part_id": "soak", "camera_id": "gate"}).encode())
        assert requester.poll(int(WAIT_S * 1000)), "no answer to the trigger request"
        reply = parse_message(requester.recv())
        requester.close(linger=0)
        assert isinstance(reply, VerdictMessage) and reply.part_id == "soak", reply
        assert self._opcua_ready.wait(WAIT_S), "no OPC UA notifications"
        assert self._opcua_error is None, self._opcua_error

    def leave(self) -> None:
        """Every client disconnects."""
        self._opcua_done.set()
        self._opcua.join(WAIT_S)
        self.stream.close()
        self.viewer.close()
        self.modbus.close()
        self.mqtt.close()
        self.sub.close(linger=0)
        self.context.term()
