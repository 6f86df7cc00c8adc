"""The control socket in process: what a local client may ask, what is refused and why, and who may connect."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_shadow import SCENE, settings

from edged.control import ControlSocket
from edged.model import load_model
from edged.pipeline import frame_path
from edged.shadow import Shadow, Swap


@pytest.fixture
def served(tmp_path: Path) -> tuple[ControlSocket, Shadow, list[Swap], zmq.Socket[bytes], Swap]:
    s = settings(tmp_path, SCENE[:2])
    shadow = Shadow(s, s.model.candidate)  # type: ignore[arg-type]
    live = load_model(s.model, s.runtime)
    current = [Swap(live, {"cam0": frame_path(s, live, s.source[0])})]
    control = ControlSocket(f"ipc://{tmp_path}/control.sock")
    context = zmq.Context.instance()
    client = context.socket(zmq.REQ)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"ipc://{tmp_path}/control.sock")
    yield control, shadow, current, client, current[0]
    client.close(linger=0)
    control.close()


def ask(served: Any, *parts: bytes) -> dict[str, Any]:
    control, shadow, current, client, _ = served
    client.send_multipart(list(parts))
    assert zmq.select(control.fds, [], [], 10)[0]
    control.serve(shadow, lambda: current[-1], current.append, None, None)
    assert client.poll(10_000)
    reply: dict[str, Any] = json.loads(client.recv())
    return reply


def test_the_socket_is_for_root_and_the_service_group_only(served: Any, tmp_path: Path) -> None:
    assert stat.S_IMODE((tmp_path / "control.sock").stat().st_mode) == 0o660


def test_garbage_and_unknown_commands_are_answered_and_change_nothing(served: Any) -> None:
    live = served[4].model.info.model_dump()
    assert ask(served, b"\xff not json") == {"ok": False, "error": "not a control request", "live": live, "previous": None}
    assert ask(served, b"[1, 2]")["error"] == "not a control request"
    assert ask(served, b"a", b"b")["error"] == "not a control request"
    assert ask(served, json.dumps({"command": "delete"}).encode())["error"] == "unknown command 'delete'"
    assert len(served[2]) == 1 and served[1].state == "on_trial"


def test_promotion_before_the_gate_is_refused_and_forced_only_with_a_reason(served: Any) -> None:
    _, shadow, current, _, live = served
    refused = ask(served, json.dumps({"command": "promote"}).encode())
    assert (
        refused["ok"] is False and refused["error"] == "promotion refused: compared on 0 frame(s) of the 3 the gate asks for"
    )
    no_reason = ask(served, json.dumps({"command": "promote", "force": True}).encode())
    assert "--reason" in no_reason["error"] and len(current) == 1
    forced = ask(served, json.dumps({"command": "promote", "force": True, "reason": "r", "user": "anna"}).encode())
    assert forced["ok"] is True and forced["forced"] is True and forced["user"] == "anna"
    assert current[-1].model is shadow.model and forced["live"] == shadow.model.info.model_dump()
    assert forced["previous"] == live.model.info.model_dump()
    back = ask(served, json.dumps({"command": "rollback"}).encode())
    assert back["ok"] is True and current[-1] is live and back["live"] == live.model.info.model_dump()
    assert ask(served, json.dumps({"command": "rollback"}).encode())["error"].startswith("nothing to roll back")
