"""The control socket in process: what a local client may ask, what is refused and why, and who may connect."""

from __future__ import annotations

import json
import logging
import os
import pwd
import stat
from pathlib import Path
from typing import Any

import pytest
import zmq
from test_shadow import SCENE, settings

from edged.control import ControlSocket
from edged.errors import PublishError
from edged.model import load_model
from edged.pipeline import frame_path
from edged.shadow import Shadow, Swap


@pytest.fixture
def served(tmp_path: Path) -> tuple[ControlSocket, Shadow, list[Swap], zmq.Socket[bytes], Swap]:
    s = settings(tmp_path, SCENE[:2])
    live = load_model(s.model, s.runtime)
    shadow = Shadow(s, s.model.candidate, live)  # type: ignore[arg-type]
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
    assert forced["ok"] is True and forced["forced"] is True and forced["claimed"] == "anna"
    assert current[-1].model is shadow.model and forced["live"] == shadow.model.info.model_dump()
    assert forced["previous"] == live.model.info.model_dump()
    back = ask(served, json.dumps({"command": "rollback"}).encode())
    assert back["ok"] is True and current[-1] is live and back["live"] == live.model.info.model_dump()
    assert ask(served, json.dumps({"command": "rollback"}).encode())["error"].startswith("nothing to roll back")


def test_the_user_logged_and_journaled_is_the_kernels_not_the_one_the_client_claims(
    served: Any, caplog: pytest.LogCaptureFixture
) -> None:
    me = pwd.getpwuid(os.getuid()).pw_name
    with caplog.at_level(logging.WARNING, logger="edged.control"):
        forced = ask(served, json.dumps({"command": "promote", "force": True, "reason": "r", "user": "mallory"}).encode())
        honest = ask(served, json.dumps({"command": "rollback", "user": me}).encode())
    assert (forced["user"], forced["pid"], forced["claimed"]) == (me, os.getpid(), "mallory")
    assert (honest["user"], honest["pid"], honest["claimed"]) == (me, os.getpid(), None)
    said = [r.getMessage() for r in caplog.records]
    assert f"by force (by {me} pid {os.getpid()}, claimed 'mallory': r;" in said[0]
    assert said[1].endswith(f"(by {me} pid {os.getpid()})") and "claimed" not in said[1]


def test_an_oversized_request_or_a_silent_client_never_blocks_the_loop(served: Any, tmp_path: Path) -> None:
    control, shadow, current, client, _ = served
    silent = zmq.Context.instance().socket(zmq.REQ)
    silent.setsockopt(zmq.LINGER, 0)
    silent.connect(f"ipc://{tmp_path}/control.sock")
    try:
        client.send(json.dumps({"command": "promote", "force": True, "reason": "r" * 2000}).encode())
        control.serve(shadow, lambda: current[-1], current.append, None, None)  # returns: nothing whole waits
        assert not client.poll(500) and len(current) == 1  # the peer was dropped, nothing promoted
        silent.send(json.dumps({"command": "delete"}).encode())  # a later client is served as before
        assert zmq.select(control.fds, [], [], 10)[0]
        control.serve(shadow, lambda: current[-1], current.append, None, None)
        assert silent.poll(10_000) and json.loads(silent.recv())["error"] == "unknown command 'delete'"
    finally:
        silent.close(linger=0)


def test_a_request_nested_deeper_than_json_decodes_is_refused_and_the_next_served(served: Any) -> None:
    # 1000 '[' in a request under the size limit: json.loads raised RecursionError, which ended the daemon.
    control, shadow, current, client, _ = served
    client.send(b"[" * 1000)
    assert zmq.select(control.fds, [], [], 10)[0]
    control.serve(shadow, lambda: current[-1], current.append, None, None)
    assert client.poll(10_000)
    answer = json.loads(client.recv())
    assert (answer["ok"], answer["error"]) == (False, "not a control request")
    client.send(json.dumps({"command": "delete"}).encode())
    assert zmq.select(control.fds, [], [], 10)[0]
    control.serve(shadow, lambda: current[-1], current.append, None, None)
    assert client.poll(10_000) and json.loads(client.recv())["error"] == "unknown command 'delete'"


def test_a_file_in_the_sockets_place_is_refused_not_replaced(tmp_path: Path) -> None:
    # Bound without the configuration's check (a file made after it was loaded): libzmq deleted it.
    (tmp_path / "notes.txt").write_text("precious\n")
    with pytest.raises(PublishError, match=r"notes.txt is a file, not a socket, which edged would replace"):
        ControlSocket(f"ipc://{tmp_path}/notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "precious\n"


def test_a_reason_that_would_forge_a_log_line_is_refused_naming_the_character(
    served: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The reason is logged as it is: a newline in it wrote a second line, a forged rollback by pid 1.
    _, shadow, current, _, _ = served
    forged = "fixture\n2026-12-06 14:00:00,000 WARNING edged.control: rolled back from model a to b (by root pid 1)"
    for reason, found in ((forged, "U+000A at character 8 is a control character"), ("ok\u202eko", "U+202E at character 3")):
        with caplog.at_level(logging.WARNING, logger="edged.control"):
            refused = ask(served, json.dumps({"command": "promote", "force": True, "reason": reason}).encode())
        assert refused["ok"] is False and refused["error"].startswith(f"promotion refused: in the reason, {found}")
    assert len(current) == 1 and shadow.state == "on_trial" and not caplog.records
