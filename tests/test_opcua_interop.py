"""The OPC UA server read by another stack than its own: node-opcua's client (Node-RED's OPC UA nodes
are built on it) runs tests/opcua_client.cjs against the real daemon, so a fault asyncua's server and
client share (encoding, types, browse names, security, endpoints, method results) shows.

scripts/setup test installs npm (apt), then the pinned node and client (npm, in .node-opcua/)."""

from __future__ import annotations

import base64
import json
import os
import re
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from daemon import RunningDaemon, free_port
from node_clients import NODE_MODULES, node
from test_trigger import running
from waiting import wait_for

from edged.messages import VerdictMessage, parse_message
from edged.opcua_server import application_uri

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
CLIENT = Path(__file__).with_name("opcua_client.cjs")
DOCS = REPO / "docs" / "outputs.md"
SERVING = "OPC UA: serving camera"
PASSWORD = "a long enough password"
DATA_TYPE_IDS = {"String": "ns=0;i=12", "UInt64": "ns=0;i=9", "Double": "ns=0;i=11"}  # OPC UA's built-in types
CAMERA = {"camera": "ns=2;s=cam0", "camera_id": "cam0"}  # the daemon's one camera, as the client names it
AWAITING = {"Verdict", "Sequence", "PartId", "CaptureToVerdictMs", "LastMessage"}  # until the first verdict


def documented_variables() -> dict[str, str]:
    """docs/outputs.md's node table of the OPC UA section: each variable's name and type."""
    text = DOCS.read_text()
    model = text[text.index("### The information model") :]
    model = model[: model.index("\n### ", 1)]
    variables: dict[str, str] = {}
    for names, kind in re.findall(r"^\| ((?:`\w+`(?:, )?)+) \| (\w+) \|", model, re.MULTILINE):
        for name in re.findall(r"`(\w+)`", names):
            variables[name] = kind
    return variables


def client_env(tmp_path: Path) -> dict[str, str]:
    """node with the installed client on its path, and a home of its own (node-opcua writes under it)."""
    return {**os.environ, "NODE_PATH": str(NODE_MODULES), "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}


def scenario(tmp_path: Path, name: str, **fields: Any) -> list[dict[str, Any]]:
    """The events of one run of the node client's ``name`` scenario, which must end well."""
    arguments = {"scenario": name, "pki": str(tmp_path / "pki"), **CAMERA, **fields}
    done = subprocess.run(
        [node("node-opcua-client"), str(CLIENT), json.dumps(arguments)],
        capture_output=True,
        text=True,
        timeout=60,
        env=client_env(tmp_path),
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"event"')]
    assert done.returncode == 0, done.stdout + done.stderr
    return events


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [event for event in events if event["event"] == kind]


def serving(d: RunningDaemon) -> None:
    assert wait_for(lambda: SERVING in d.log(), 60), d.log()


def source_ns(value: dict[str, Any]) -> int:
    """A value's source timestamp, ns: node-opcua gives ms and the picoseconds below."""
    return int(value["source_ms"]) * 1_000_000 + int(value["source_ps"]) // 1000


def assert_node_table(browsed: dict[str, Any], documented: dict[str, str], method: bool) -> None:
    """Objects/edged/cam0 holds what the docs' table lists, each with its browse and display name."""
    ns = browsed["ns"]
    assert browsed["namespaces"][ns] == "urn:edged" and browsed["camera"] == f"ns={ns};s=cam0", browsed
    children = {child["browse_name"]: child for child in browsed["children"]}
    assert set(children) == set(documented) | ({"Trigger"} if method else set()), children
    for name, child in children.items():
        assert child["ns"] == ns and child["display_name"] == name, child
        assert child["node_id"] == f"ns={ns};s=cam0.{name}", child
        assert child["node_class"] == ("Method" if name == "Trigger" else "Variable"), child


def assert_typed(values: dict[str, Any], documented: dict[str, str]) -> None:
    """Each variable's DataType attribute and value's type are the documented ones, and it is read-only."""
    for name, kind in documented.items():
        value = values[name]
        assert value["data_type"] == DATA_TYPE_IDS[kind], (name, value)
        assert value["access_level"] == 1, (name, value)  # CurrentRead only
        if value["status"] == "Good":
            assert value["type"] == kind, (name, value)


def test_node_opcua_browses_reads_subscribes_and_triggers_anonymously(tmp_path: Path) -> None:
    node("node-opcua-client")
    documented = documented_variables()
    assert set(documented) == {"Verdict", "Sequence", "PartId", "OkCount", "NgCount", "State"} | {
        "CaptureToVerdictMs",
        "LastMessage",
    }, documented
    port = free_port()
    url = f"opc.tcp://127.0.0.1:{port}"
    with running(tmp_path, fps=10, opcua={"listen": url}) as d:
        serving(d)
        events = scenario(tmp_path, "anonymous", url=url, root="ns=2;s=edged")
        on_zmq = [m for m in d.collect("verdict", 2, timeout=20) if isinstance(m, VerdictMessage)]

        [listed] = of(events, "endpoints")
        assert listed["endpoints"] == [
            {
                "url": url,
                "mode": "None",
                "policy": "None",
                "application_uri": application_uri(),
                "tokens": ["Anonymous"],
                "certificate": None,
            }
        ]
        [browsed] = of(events, "browse")
        assert_node_table(browsed, documented, method=True)
        before, after = (event["values"] for event in of(events, "read"))
        assert_typed(before, documented)
        assert_typed(after, documented)
        for name in AWAITING:
            assert before[name]["status"] == "BadWaitingForInitialData", (name, before[name])
        assert before["OkCount"]["value"] == before["NgCount"]["value"] == "0"
        assert before["State"]["status"] == "Good" and before["State"]["value"] in {"starting", "ok"}

        calls = {event["label"]: event for event in of(events, "call")}
        replies = []
        for label, part in (("part", "P1"), ("empty", None)):
            call = calls[label]
            assert call["status"] == "Good" and call["input_results"] == ["Good"], call
            [output] = call["output"]
            assert output["type"] == "String", call
            reply = parse_message(output["value"].encode())
            assert isinstance(reply, VerdictMessage) and reply.part_id == part and reply.verdict == "ng", reply
            replies.append(reply)
        too_long = parse_message(calls["too long"]["output"][0]["value"].encode())
        assert calls["too long"]["status"] == "Good" and too_long.kind == "trigger_error", calls["too long"]
        # Arguments that are not Trigger's one String: OPC UA's statuses, and no verdict.
        assert calls["int32"]["status"] == "BadInvalidArgument", calls["int32"]
        assert calls["int32"]["input_results"] == ["BadTypeMismatch"], calls["int32"]
        assert calls["none"]["status"] == "BadArgumentsMissing", calls["none"]
        assert calls["two"]["status"] == "BadTooManyArguments", calls["two"]
        assert calls["other object"]["status"] == "BadMethodInvalid", calls["other object"]
        assert [r.seq for r in replies] == [m.seq for m in on_zmq] == [0, 1]
        assert replies == on_zmq  # the replies are the verdicts the ZeroMQ stream published

        # The subscriber heard each verdict, its values with the frame's capture time.
        changes = of(events, "change")
        sequences = [c for c in changes if c["name"] == "Sequence"]
        assert sequences[0]["status"] == "BadWaitingForInitialData", sequences
        assert [c["value"] for c in sequences[1:]] == ["0", "1"], sequences
        messages = [c for c in changes if c["name"] == "LastMessage" and c["status"] == "Good"]
        verdicts = [c for c in changes if c["name"] == "Verdict" and c["status"] == "Good"]
        assert [parse_message(c["value"].encode()) for c in messages] == on_zmq
        assert [c["value"] for c in verdicts] == ["NG", "NG"]  # StatusValueTimestamp: each verdict
        for sent, sequence, message, verdict in zip(on_zmq, sequences[1:], messages, verdicts, strict=True):
            for change in (sequence, message, verdict):
                assert abs(source_ns(change) - sent.capture_time_ns) < 1000, (change, sent)

        # Read afterwards: the last verdict, as ZeroMQ published it, stamped with its capture time.
        last = on_zmq[-1]
        assert {name: value["status"] for name, value in after.items()} == dict.fromkeys(documented, "Good")
        assert after["Verdict"]["value"] == "NG" and after["Sequence"]["value"] == "1"
        assert after["PartId"]["value"] == "" and after["NgCount"]["value"] == "2" and after["OkCount"]["value"] == "0"
        assert after["CaptureToVerdictMs"]["value"] == last.verdict_latency_ms
        assert parse_message(after["LastMessage"]["value"].encode()) == last
        assert abs(source_ns(after["Sequence"]) - last.capture_time_ns) < 1000
        [read_after] = of(events, "read")[1:]
        assert abs(after["Sequence"]["server_ms"] - read_after["now_ms"]) < 10_000  # the wall clock, not another
        # Read-only to all, no user's right lacking: OPC UA's statuses, as a PLC tool shows them.
        assert {event["label"]: event["status"] for event in of(events, "write")} == {
            "value": "BadNotWritable",
            "display name": "BadNotWritable",
            "description": "BadNotWritable",
            "camera's display name": "BadNotWritable",
            "executable": "BadAttributeIdInvalid",
            "camera's value rank": "BadAttributeIdInvalid",
            "unknown node": "BadNodeIdUnknown",
            "unknown node's display name": "BadNodeIdUnknown",
        }
        assert of(events, "closed")

        # A client killed with its session and subscription open: said, and every other client served.
        assert "its session and 1 subscription are kept for it to reconnect" in killed(d, tmp_path, url=url)

        # What a user gets wrong is refused by the client, saying why; the server goes on.
        attempts = {event["label"]: event for event in of(scenario(tmp_path, "mistakes", url=url), "attempt")}
        assert "must exist" in attempts["wrong path"]["error"], attempts
        assert "Cannot find an Endpoint matching" in attempts["SignAndEncrypt"]["error"], attempts
        assert "USERNAME" in attempts["user name"]["error"], attempts
        assert attempts["good"]["ok"] and attempts["good"]["state"] == "ok", attempts
        assert d.proc.poll() is None, d.log()
        assert "socket.send() raised exception" not in d.log()


def killed(d: RunningDaemon, tmp_path: Path, subscribe: tuple[str, ...] = ("State", "Sequence"), **fields: str) -> str:
    """The daemon's line saying that a client killed with its session open (the linger scenario:
    ``subscribe`` monitored in a subscription, unless empty) went away."""
    arguments = {"scenario": "linger", "pki": str(tmp_path / "pki"), "subscribe": subscribe, **CAMERA, **fields}
    linger = subprocess.Popen(
        [node("node-opcua-client"), str(CLIENT), json.dumps(arguments)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=client_env(tmp_path),
    )
    try:
        assert ready(linger, 30), "the lingering client never got its session"
    finally:
        linger.send_signal(signal.SIGKILL)
        linger.wait()
        assert linger.stdout is not None
        linger.stdout.close()
    gone = "went away without closing its session"
    assert wait_for(lambda: gone in d.log(), 15), d.log()
    return next(line for line in d.log().splitlines() if gone in line)


def ready(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether ``proc`` printed its ready event within ``timeout_s``."""
    assert proc.stdout is not None
    fd, seen = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while b'{"event":"ready"' not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        seen += chunk
    return True


def test_node_opcua_signs_in_over_basic256sha256_sign_and_encrypt(tmp_path: Path) -> None:
    node("node-opcua-client")
    documented = documented_variables()
    port = free_port()
    users, certs = tmp_path / "opcua-users", tmp_path / "opcua"
    users.write_text(f"plc:{PASSWORD}\n")
    users.chmod(0o600)
    listen = f"opc.tcp://0.0.0.0:{port}"
    opcua = {"listen": listen, "users_file": str(users), "cert_dir": str(certs)}
    with running(tmp_path, fps=10, trigger={"mode": "free"}, inspect={}, opcua=opcua) as d:
        serving(d)
        der = (certs / "server.der").read_bytes()
        urls = [f"opc.tcp://127.0.0.1:{port}", f"opc.tcp://localhost:{port}"]
        events = scenario(
            tmp_path,
            "secured",
            url=urls[0],
            urls=urls,
            untrusted_pki=str(tmp_path / "untrusting"),
            server_der=str(certs / "server.der"),
            user="plc",
            password=PASSWORD,
            changes=5,
        )

        # Each endpoint is the address the client asked for (listening on 0.0.0.0, no endpoint says
        # 0.0.0.0), under the certificate in cert_dir, whose URI is the server's application URI.
        for asked, listed in zip(urls, of(events, "endpoints"), strict=True):
            assert listed["asked"] == asked
            [endpoint] = listed["endpoints"]
            assert endpoint["url"] == asked, endpoint
            assert (endpoint["mode"], endpoint["policy"], endpoint["tokens"]) == (
                "SignAndEncrypt",
                "Basic256Sha256",
                ["UserName"],
            ), endpoint
            assert endpoint["application_uri"] == application_uri()
            assert base64.b64decode(endpoint["certificate"]) == der
        made = x509.load_der_x509_certificate(der)
        names = made.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        assert names.value.get_values_for_type(x509.UniformResourceIdentifier) == [application_uri()]
        # The key identifiers stacks that build chains look for (OPC UA Part 6, 6.2.2): self-signed,
        # its authority is itself.
        key_id = made.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        authority = made.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
        assert key_id == x509.SubjectKeyIdentifier.from_public_key(made.public_key())
        assert authority.key_identifier == key_id.digest, authority
        assert authority.authority_cert_issuer == [x509.DirectoryName(made.issuer)], authority
        assert authority.authority_cert_serial_number == made.serial_number, authority

        attempts = {event["label"]: event for event in of(events, "attempt")}
        assert "BadCertificateUntrusted" in attempts["untrusted server"]["error"], attempts  # until trusted
        assert "must exist" in attempts["None"]["error"], attempts
        assert "Cannot find an Endpoint matching" in attempts["Sign"]["error"], attempts
        assert "ANONYMOUS" in attempts["anonymous"]["error"], attempts
        assert "BadUserAccessDenied" in attempts["wrong password"]["error"], attempts
        assert not any(event["ok"] for event in attempts.values()), attempts
        assert "sign-in refused for user 'plc'" in d.log()
        # asyncua's record of the fault answering the wrong password: the client's mistake, a warning.
        fault = "WARNING asyncua.server.uaprocessor: sending service fault response"
        assert wait_for(lambda: fault in d.log(), 15), d.log()
        assert "ERROR asyncua" not in d.log(), d.log()

        [browsed] = of(events, "browse")
        assert_node_table(browsed, documented, method=False)
        [signed_in] = of(events, "read")
        assert_typed(signed_in["values"], documented)
        assert {value["status"] for value in signed_in["values"].values()} == {"Good"}

        # Free-running: a data change per frame's verdict, in order, each with its message and capture time.
        changes = of(events, "change")
        sequences = [c for c in changes if c["name"] == "Sequence"]
        messages = {source_ns(c): json.loads(c["value"]) for c in changes if c["name"] == "LastMessage"}
        seqs = [int(c["value"]) for c in sequences]
        assert len(seqs) >= 5 and seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        for sequence in sequences[1:]:  # the first is the value when subscribed, perhaps before LastMessage's
            message = messages[source_ns(sequence)]
            assert message["seq"] == int(sequence["value"]), (sequence, message)
            assert abs(source_ns(sequence) - message["capture_time_ns"]) < 1000
        assert of(events, "closed")
        # Signed in, killed with its session open and nothing subscribed: said as it is.
        line = killed(d, tmp_path, (), url=urls[0], user="plc", password=PASSWORD)
        assert "its session, which holds no subscription, is kept" in line, line
        assert d.proc.poll() is None, d.log()
