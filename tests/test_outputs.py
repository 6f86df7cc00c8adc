"""edged.outputs: an output added with one registry line sees every frame, verdict and status, a reload and the close."""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest

import edged.outputs
from edged.config import Settings, load_config
from edged.daemon import Daemon
from edged.errors import BindError
from edged.messages import parse_message
from edged.output import Delivery, Endpoint, FrameReport, Output, OutputReport, Services, StatusReport
from edged.service import Notifier, Signals
from tests.daemon import free_port, write_config
from tests.waiting import wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent


class Recorder(Output):
    """An output that keeps what reaches it, on the loop's thread, and adds a counter to the status."""

    made: ClassVar[list[Recorder]] = []

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.frames: list[FrameReport] = []
        self.statuses: list[StatusReport] = []
        self.reloads: list[Settings] = []
        self.closed = threading.Event()
        Recorder.made.append(self)

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> Recorder:
        return cls(settings)

    def wants(self, camera_id: str, found: bool) -> Delivery:
        return Delivery.SENT

    def frame(self, report: FrameReport) -> None:
        self.frames.append(report)

    def status(self, reports: Sequence[StatusReport]) -> None:
        self.statuses.extend(reports)

    def report(self, camera_id: str) -> OutputReport:
        return OutputReport(drops={"recorder_seen": len(self.frames)})

    def reload(self, settings: Settings, services: Services) -> Recorder:
        self.reloads.append(settings)
        return self

    def close(self) -> None:
        self.closed.set()


def _config(path: Path, conf: float, port: int) -> Path:
    return write_config(
        path,
        {
            "source": {"type": "synthetic", "camera_id": "line", "width": 320, "height": 240, "fps": 30.0},
            "model": {"path": str(REPO / "models/demo.onnx"), "labels": str(REPO / "models/demo.labels")},
            "publish": {"endpoints": [f"tcp://127.0.0.1:{port}"], "status_interval_s": 0.2},
            "thermal": {"enabled": False},
            "inspect": {"class_conf": {"crack": conf}},
        },
    )


def test_a_registered_output_sees_every_frame_verdict_and_status_a_reload_and_the_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(edged.outputs, "OUTPUTS", (*edged.outputs.OUTPUTS, Recorder))
    Recorder.made.clear()
    config = _config(tmp_path / "edged.toml", 0.3, free_port())
    signals = Signals()
    daemon = Daemon(load_config(config), config, Notifier(), signals)
    code: list[int] = []
    loop = threading.Thread(target=lambda: code.append(daemon.run()))
    loop.start()
    try:
        (recorder,) = Recorder.made
        assert wait_for(lambda: len(recorder.frames) >= 5 and len(recorder.statuses) >= 2, 60)
        _config(config, 0.5, free_port())
        signals.reload.set()
        assert wait_for(lambda: recorder.reloads, 60)
        assert recorder.reloads[0].inspect is not None and recorder.reloads[0].inspect.class_conf == {"crack": 0.5}
        seen = len(recorder.frames)
        assert wait_for(lambda: len(recorder.frames) >= seen + 3, 60)
    finally:
        signals.stop.set()
        loop.join(30)
    assert code == [0] and recorder.closed.is_set()
    frames = recorder.frames
    # Every frame, each sent with its gapless seq and its verdict beside it.
    assert [f.message.seq for f in frames if f.message] == list(range(len(frames)))
    assert all(f.payload is not None and parse_message(f.payload).seq == f.message.seq for f in frames if f.message)
    assert [f.verdict.seq for f in frames if f.verdict] == list(range(len(frames)))
    assert all(f.camera_id == "line" and f.verdict_payload for f in frames)
    # Every status round, the last one at stop; what the output adds is in the status message.
    seqs = [s.message.seq for s in recorder.statuses]
    assert seqs == list(range(len(seqs))) and {s.message.camera_id for s in recorder.statuses} == {"line"}
    assert recorder.statuses[-1].message.drops["recorder_seen"] == len(frames)


class Server(Output):
    """An output that listens, as a Modbus or OPC UA server would: it lists its address, and check binds it."""

    @classmethod
    def from_settings(cls, settings: Settings, services: Services) -> None:
        return None

    @classmethod
    def listening(cls, settings: Settings) -> list[Endpoint]:
        return [Endpoint("server.port", "tcp://127.0.0.1:1", lambda: lambda: None)]


def test_every_address_the_daemon_listens_on_is_listed_with_its_key_and_binds_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = [free_port() for _ in range(3)]
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic"},
            "model": {"path": str(REPO / "models/demo.onnx")},
            "publish": {"endpoints": [f"tcp://127.0.0.1:{ports[0]}"]},
            "http": {"listen": f"127.0.0.1:{ports[1]}"},
            "trigger": {"mode": "request", "endpoint": f"tcp://127.0.0.1:{ports[2]}"},
        },
    )
    settings = load_config(config)
    endpoints = edged.outputs.listening(settings)
    assert [(e.key, e.address) for e in endpoints] == [
        ("publish.endpoints", f"tcp://127.0.0.1:{ports[0]}"),
        ("http.listen", f"http://127.0.0.1:{ports[1]}/"),
        ("trigger.endpoint", f"tcp://127.0.0.1:{ports[2]}"),
    ]
    releases = [endpoint.bind() for endpoint in endpoints]
    try:
        for endpoint, port in zip(endpoints, ports, strict=True):
            with pytest.raises(BindError, match=rf"{re.escape(endpoint.key)}.*{port}|{port}.*{re.escape(endpoint.key)}"):
                endpoint.bind()
    finally:
        for release in releases:
            release()
    for release in [endpoint.bind() for endpoint in endpoints]:  # released: free again
        release()
    monkeypatch.setattr(edged.outputs, "OUTPUTS", (*edged.outputs.OUTPUTS, Server))
    assert [e.key for e in edged.outputs.listening(settings)][-2:] == ["server.port", "trigger.endpoint"]
