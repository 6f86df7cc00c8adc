"""The OPC UA output on the running daemon, read by real OPC UA clients over TCP: asyncua's client,
and asyncua's command-line tools (``uals``, ``uaread``) as an independent one."""

from __future__ import annotations

import asyncio
import datetime
import gc
import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from asyncua import Client, ua
from asyncua.client.ua_client import UASocketState
from asyncua.crypto.security_policies import SecurityPolicyBasic256Sha256
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID
from daemon import RunningDaemon, free_port, rss_kb, run_cli, write_config
from filesystems import fill, tmpfs
from onnx_models import colour_probe
from reports import inspecting, ng_report
from test_clock_steps import FAKETIME, needs_faketime
from test_prometheus import _status as camera_status
from test_trigger import ready, running
from waiting import wait_for

from edged.config import Settings, load_config
from edged.errors import EXIT_CONFIG, ConfigError, KeyFileError, OutputFileError
from edged.journal import JournalOutput
from edged.messages import TriggerError, VerdictMessage, parse_message
from edged.model import load_model
from edged.opcua import OpcuaOutput, describe, opcua_problems, try_listen
from edged.opcua_server import (
    CERT_FILE,
    KEY_FILE,
    VARIABLES,
    BoundedLog,
    UaServer,
    application_uri,
    cert_dir_problem,
    quiet_asyncua,
    read_users,
    server_certificate,
)
from edged.output import Services, StatusReport
from edged.outputs import Outputs
from edged.settings.opcua import OpcuaConfig

SERVING = "OPC UA: serving camera"
TIMEOUT_S = 30.0  # a client's request timeout: generous, both cores may be busy
PASSWORD = "a long enough password"


def url(port: int, host: str = "127.0.0.1") -> str:
    return f"opc.tcp://{host}:{port}"


def serving(d: RunningDaemon) -> None:
    assert wait_for(lambda: SERVING in d.log(), 60), d.log()


def client(address: str) -> Client:
    return Client(address, timeout=TIMEOUT_S)


def closed(c: Client) -> bool:
    """Whether the server has closed the client's connection."""
    protocol = c.uaclient.protocol
    return protocol is not None and protocol.state == UASocketState.CLOSED


async def camera_node(c: Client, camera_id: str = "cam0") -> Any:
    ns = await c.get_namespace_index("urn:edged")
    return await c.nodes.objects.get_child([f"{ns}:edged", f"{ns}:{camera_id}"]), ns


async def until(predicate: Callable[[], bool], timeout_s: float = 60) -> bool:
    """`waiting.wait_for` for a test's event loop, which must go on serving the client meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def written(node: Any, timeout_s: float = 60) -> Any:
    """The node's value once the first verdict has been written to it (until then it is
    Bad_WaitingForInitialData: the ZeroMQ stream may tell of a verdict a moment before)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await node.read_value()
        except ua.UaStatusCodeError as e:
            if "WaitingForInitialData" not in type(e).__name__ or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


class Notifications:
    """asyncua's subscription handler: every data change, with the node it is of."""

    def __init__(self) -> None:
        self.changes: list[tuple[str, Any, ua.DataValue]] = []

    def datachange_notification(self, node: Any, val: Any, data: Any) -> None:
        self.changes.append((str(node.nodeid.Identifier), val, data.monitored_item.Value))

    def of(self, name: str) -> list[tuple[Any, ua.DataValue]]:
        return [(val, value) for identifier, val, value in self.changes if identifier == f"cam0.{name}"]


@pytest.mark.integration
def test_a_subscriber_gets_one_set_of_notifications_per_verdict_in_the_order_of_the_verdict_stream(
    tmp_path: Path,
) -> None:
    port = free_port()
    with running(tmp_path, trigger={"mode": "free"}, inspect={}, opcua={"listen": url(port)}) as d:
        serving(d)

        async def watch() -> Notifications:
            async with client(url(port)) as c:
                camera, ns = await camera_node(c)
                names = {(await child.read_browse_name()).Name for child in await camera.get_children()}
                assert names == set(VARIABLES)  # free-running: no Trigger
                handler = Notifications()
                asked = ua.CreateSubscriptionParameters(RequestedPublishingInterval=0, RequestedMaxKeepAliveCount=10)
                granted = await c.uaclient.create_subscription(asked, lambda result: None)
                assert granted.RevisedPublishingInterval == 10  # never 0: a publish per value would split the sets
                await c.uaclient.delete_subscriptions([granted.SubscriptionId])
                sub = await c.create_subscription(50, handler)
                verdict = await camera.get_child(f"{ns}:Verdict")
                sequence = await camera.get_child(f"{ns}:Sequence")
                message = await camera.get_child(f"{ns}:LastMessage")
                # Verdict stays "NG" here: its timestamp tells one verdict from the next.
                each = ua.DataChangeFilter(Trigger=ua.DataChangeTrigger.StatusValueTimestamp)
                await sub._subscribe([verdict, sequence, message], mfilter=each, queuesize=20)
                assert await until(lambda: len(handler.of("Sequence")) >= 6), handler.changes
                await sub.delete()
                return handler

        handler = asyncio.run(watch())
        on_zmq = {m.seq: m for m in d.collect("verdict", 3, timeout=30) if isinstance(m, VerdictMessage)}
    sequences = handler.of("Sequence")[1:]  # the first is the value when subscribed
    verdicts, messages = handler.of("Verdict")[1:], handler.of("LastMessage")[1:]
    seqs = [val for val, _ in sequences]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # each verdict once, in order
    # One set per verdict: the same source timestamp (its frame's capture) on each of its values.
    stamps = [value.SourceTimestamp for _, value in sequences]
    assert [value.SourceTimestamp for _, value in verdicts[: len(stamps)]] == stamps
    assert {val for val, _ in verdicts} == {"NG"}
    for (seq, value), (text, _) in zip(sequences, messages, strict=False):
        sent = parse_message(text.encode())
        assert isinstance(sent, VerdictMessage) and sent.seq == seq
        assert abs(value.SourceTimestamp.timestamp() * 1e9 - sent.capture_time_ns) < 1e3
    # The same verdicts as on ZeroMQ's verdict topic, seq for seq.
    for seq, sent in on_zmq.items():
        text = next((t for t, _ in messages if json.loads(t)["seq"] == seq), None)
        if text is not None:
            assert parse_message(text.encode()) == sent


@pytest.mark.integration
def test_uals_and_uaread_browse_and_read_the_camera(tmp_path: Path) -> None:
    if shutil.which("uaread", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("asyncua's command-line tools are not installed")
    port = free_port()
    with running(tmp_path, trigger={"mode": "free"}, inspect={}, opcua={"listen": url(port)}) as d:
        serving(d)
        d.wait_status(lambda s: s.opcua is not None and s.opcua.updates >= 1, timeout=60)
        tools = Path(sys.executable).parent
        listed = subprocess.run(
            [str(tools / "uals"), "-u", url(port), "-n", "ns=2;s=cam0", "-l", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert listed.returncode == 0, listed.stderr
        for name in VARIABLES:
            assert f"2:{name}" in listed.stdout, listed.stdout
        read = subprocess.run(
            [str(tools / "uaread"), "-u", url(port), "-n", "ns=2;s=cam0.Verdict"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert read.returncode == 0, read.stderr
        assert read.stdout.strip() == "NG", read.stdout


@pytest.mark.integration
def test_trigger_returns_the_verdict_of_a_frame_captured_after_the_call(tmp_path: Path) -> None:
    port = free_port()
    with running(tmp_path, opcua={"listen": url(port)}) as d:
        serving(d)
        ready(d, frames=3)

        async def ask() -> list[tuple[int, str]]:
            async with client(url(port)) as c:
                camera, ns = await camera_node(c)
                method = await camera.get_child(f"{ns}:Trigger")
                sequence = await camera.get_child(f"{ns}:Sequence")
                with pytest.raises(ua.UaStatusCodeError, match="WaitingForInitialData"):
                    await sequence.read_value()  # no verdict yet
                watcher = client(url(port))  # a subscription of its own: a call holds its session
                await watcher.connect()
                handler = Notifications()
                sub = await watcher.create_subscription(50, handler)
                await sub.subscribe_data_change(watcher.get_node(sequence.nodeid), queuesize=10)  # default trigger
                replies = []
                for part in ("P1", "P2", ""):
                    sent_ns = time.time_ns()
                    replies.append((sent_ns, await camera.call_method(method, ua.Variant(part, ua.VariantType.String))))
                bad = await camera.call_method(method, ua.Variant("x" * 1000, ua.VariantType.String))
                replies.append((0, bad))
                # Verdict 0 too, though Sequence was 0 before it: it ends the wait for initial data.
                assert await until(lambda: [val for val, _ in handler.of("Sequence")][-3:] == [0, 1, 2]), handler.changes
                await watcher.disconnect()
                return replies

        replies = asyncio.run(ask())
        assert d.wait_status(lambda s: s.opcua is not None and s.opcua.requests >= 4, timeout=30)
    for (sent_ns, text), part in zip(replies[:3], ("P1", "P2", None), strict=True):
        verdict = parse_message(text.encode())
        assert isinstance(verdict, VerdictMessage), text
        assert verdict.part_id == part and verdict.verdict == "ng" and verdict.capture_time_ns > sent_ns
    error = parse_message(replies[3][1].encode())
    assert isinstance(error, TriggerError) and error.error == "bad_request" and "partId" in error.detail


@pytest.mark.integration
def test_status_metrics_and_live_view_show_the_clients_and_requests_served(tmp_path: Path) -> None:
    port, http = free_port(), free_port()
    with running(tmp_path, opcua={"listen": url(port)}, http={"listen": f"127.0.0.1:{http}"}) as d:
        serving(d)
        ready(d, frames=2)

        async def connected() -> tuple[bytes, bytes, Any]:
            async with client(url(port)) as c:
                camera, ns = await camera_node(c)
                await camera.call_method(await camera.get_child(f"{ns}:Trigger"), ua.Variant("P1", ua.VariantType.String))
                loop = asyncio.get_running_loop()
                status = await loop.run_in_executor(
                    None,
                    d.wait_status,
                    lambda s: s.opcua is not None and (s.opcua.clients, s.opcua.requests, s.opcua.updates) == (1, 1, 1),
                )

                # /metrics reads the live view's last status, handed to it just after the stream's.
                def counted() -> bool:
                    metrics = _get(f"http://127.0.0.1:{http}/metrics")
                    return b"edged_opcua_clients 1.0" in metrics and b"edged_opcua_requests_total 1.0" in metrics

                assert await loop.run_in_executor(None, wait_for, counted, 30)
                metrics = await loop.run_in_executor(None, _get, f"http://127.0.0.1:{http}/metrics")
                page = await loop.run_in_executor(None, _get, f"http://127.0.0.1:{http}/")
                return metrics, page, status

        metrics, page, status = asyncio.run(connected())
        assert status.opcua.serving and status.opcua.listen == url(port)
        assert status.opcua.update_ms.p99_ms > 0 and status.drops["opcua_dropped"] == 0
        assert b"edged_opcua_clients 1.0" in metrics and b"edged_opcua_requests_total 1.0" in metrics
        assert b'id="opcua"' in page and b"s.opcua" in page
        after = d.wait_status(lambda s: s.opcua is not None and s.opcua.clients == 0)
        assert after.opcua is not None and after.opcua.requests == 1
        assert d.stop() == 0


def _get(address: str) -> bytes:
    with urllib.request.urlopen(address, timeout=30) as answer:
        return bytes(answer.read())


@pytest.mark.integration
def test_off_loopback_without_a_users_file_is_refused_at_load_with_exit_78(tmp_path: Path) -> None:
    text = f'[model]\npath = "m.onnx"\n[opcua]\nlisten = "{url(4840, "0.0.0.0")}"\n'
    (tmp_path / "m.onnx").write_bytes(b"x")
    config = tmp_path / "edged.toml"
    config.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert "opcua.listen 'opc.tcp://0.0.0.0:4840' is not a loopback address: set opcua.users_file" in str(info.value)
    result = run_cli("run", "--config", str(config))
    assert result.returncode == 78, result.stderr
    assert "opcua.users_file" in result.stderr


def _users(tmp_path: Path, mode: int = 0o600) -> Path:
    users = tmp_path / "opcua-users"
    users.write_text(f"# who may sign in\nplc:{PASSWORD}\n")
    users.chmod(mode)
    return users


@pytest.mark.integration
def test_a_users_file_others_can_read_is_refused_at_load(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"x")
    users = _users(tmp_path, 0o644)
    config = tmp_path / "edged.toml"
    config.write_text(f'[model]\npath = "m.onnx"\n[opcua]\nusers_file = "{users}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert f"opcua.users_file: permissions 0644 on {users} are too open" in str(info.value)


@pytest.mark.integration
def test_off_loopback_only_signed_in_encrypted_clients_are_served(tmp_path: Path) -> None:
    port = free_port()
    users, certs = _users(tmp_path), tmp_path / "opcua"
    mine = server_certificate(tmp_path / "client")  # the client's own certificate, as any would have
    with running(
        tmp_path,
        trigger={"mode": "free"},
        inspect={},
        opcua={"listen": url(port, "0.0.0.0"), "users_file": str(users), "cert_dir": str(certs)},
    ) as d:
        serving(d)
        server_cert = certs / "server.der"
        assert server_cert.is_file() and stat.S_IMODE((certs / "server.pem").stat().st_mode) == 0o600

        async def secured(user: str | None, password: str | None) -> str:
            c = client(url(port))
            await c.set_security(
                SecurityPolicyBasic256Sha256,
                certificate=str(mine[0]),
                private_key=str(mine[1]),
                server_certificate=str(server_cert),
                mode=ua.MessageSecurityMode.SignAndEncrypt,
            )
            if user is not None:
                c.set_user(user)
                c.set_password(password or "")
            async with c:
                camera, ns = await camera_node(c)
                return str(await written(await camera.get_child(f"{ns}:Verdict")))

        async def plain() -> None:
            async with client(url(port)):
                pass

        assert asyncio.run(secured("plc", PASSWORD)) == "NG"
        with pytest.raises(Exception):  # noqa: B017 - refused however asyncua words it
            asyncio.run(plain())
        with pytest.raises(Exception):  # noqa: B017
            asyncio.run(secured(None, None))
        # asyncua's record of a sign-in with a kind of token the server does not offer (anonymous,
        # where only user names are): the client's mistake, a warning as the fault answering it.
        rejected = "WARNING asyncua.server.internal_session: Rejected active session UserIdentityToken not supported"
        assert wait_for(lambda: rejected in d.log(), 15), d.log()
        assert "ERROR asyncua" not in d.log(), d.log()
        with pytest.raises(Exception):  # noqa: B017
            asyncio.run(secured("plc", "wrong"))
        assert "sign-in refused for user 'plc'" in d.log()
        refused = d.wait_status(lambda s: s.opcua is not None and s.opcua.refused >= 1)
        assert refused.opcua is not None and refused.opcua.refused == 1
        # A reload reads the users file again: the new password from the next sign-in on.
        users.write_text("plc:a new password\n")
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "reloaded: model" in d.log(), 60), d.log()
        assert asyncio.run(secured("plc", "a new password")) == "NG"
        with pytest.raises(Exception):  # noqa: B017
            asyncio.run(secured("plc", PASSWORD))
        # Made once: a restart keeps the certificate clients were told to trust.
        assert (certs / "server.der").read_bytes() == server_cert.read_bytes()


@pytest.mark.integration
def test_check_binds_the_listen_address_and_a_busy_one_is_exit_1_naming_it(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "imgs").mkdir()
    colour_probe(tmp_path / "probe.onnx")
    cv2.imwrite(str(tmp_path / "imgs" / "red.png"), np.full((96, 128, 3), (0, 0, 200), np.uint8))
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "images", "path": str(tmp_path / "imgs")},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [f"tcp://127.0.0.1:{free_port()}"]},
            "thermal": {"enabled": False},
            "opcua": {"listen": url(port)},
        },
    )
    result = run_cli("check", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"listen     opcua.listen: {url(port)} (bound and released)" in result.stdout
    assert f"opcua      {url(port)}: verdicts of no camera (none has [inspect]); anonymous, unencrypted" in result.stdout
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        busy = run_cli("check", "--config", str(config))
        assert busy.returncode == 1, busy.stdout + busy.stderr
        assert f"opcua.listen {url(port)}: the OPC UA server cannot listen there" in busy.stderr


@pytest.mark.integration
def test_a_busy_port_at_run_is_logged_and_retried_while_verdicts_go_on_and_served_once_free(tmp_path: Path) -> None:
    # Not exit 1: systemd would restart edged into the same taken port, and no verdict would flow meanwhile.
    port = free_port()
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    try:
        with running(tmp_path, trigger={"mode": "free"}, inspect={}, opcua={"listen": url(port)}) as d:
            ready(d, frames=3)
            assert wait_for(lambda: "the OPC UA server cannot listen there" in d.log(), 30), d.log()
            status = d.wait_status(lambda s: s.frames_processed >= 6)
            assert status.opcua is not None and not status.opcua.serving
            held.close()
            serving(d)
            assert d.log().count("cannot listen there") == 1  # said once, not at every try

            async def read() -> Any:
                async with client(url(port)) as c:
                    camera, ns = await camera_node(c)
                    return await written(await camera.get_child(f"{ns}:Verdict"))

            assert asyncio.run(read()) == "NG"
    finally:
        held.close()


@pytest.mark.integration
def test_a_disk_that_takes_no_certificate_at_run_is_retried_while_verdicts_go_on_and_served_once_it_does(
    tmp_path: Path,
) -> None:
    """The certificate is made at the first start: on a full disk that was exit 78, as if the configuration
    were wrong, and systemd would not start edged again once the disk was freed."""
    port, users, state = free_port(), _users(tmp_path), tmp_path / "state"
    with tmpfs(state, "size=64k") as mounted:
        if not mounted:
            pytest.skip("a small tmpfs needs root and mount")
        fill(state / "filler")
        opcua = {"listen": url(port), "users_file": str(users), "cert_dir": str(state / "opcua")}
        with running(tmp_path, trigger={"mode": "free"}, inspect={}, opcua=opcua) as d:
            ready(d, frames=3)
            assert wait_for(lambda: "cannot make the server certificate" in d.log(), 30), d.log()
            status = d.wait_status(lambda s: s.frames_processed >= 6)
            assert status.opcua is not None and not status.opcua.serving
            (state / "filler").unlink()
            serving(d)
            assert d.log().count("cannot make the server certificate") == 1, d.log()  # said once, not at every try
            assert (state / "opcua" / CERT_FILE).is_file() and (state / "opcua" / KEY_FILE).is_file()


@pytest.mark.integration
def test_fifty_clients_and_one_that_never_reads_stay_bounded(tmp_path: Path) -> None:
    port = free_port()
    with running(tmp_path, trigger={"mode": "free"}, inspect={}, opcua={"listen": url(port), "max_clients": 10}) as d:
        serving(d)
        ready(d, frames=2)
        before = rss_kb(d.proc.pid)
        # A client that subscribes and then stops: it neither reads nor acknowledges any more.
        stopped = subprocess.Popen([sys.executable, "-c", STALLED, url(port)], stdout=subprocess.PIPE, text=True)
        try:
            assert stopped.stdout is not None and stopped.stdout.readline().strip() == "subscribed"
            os.kill(stopped.pid, 19)  # SIGSTOP

            async def many() -> int:
                async def one() -> bool:
                    c = client(url(port))
                    connecting = asyncio.ensure_future(c.connect())
                    # The server closes a connection over max_clients at once; asyncua's client
                    # would wait out its request timeout for the answer to its Hello.
                    await until(lambda: connecting.done() or closed(c), TIMEOUT_S)
                    if not connecting.done() or connecting.exception() is not None:
                        connecting.cancel()
                        return False
                    try:
                        await asyncio.sleep(1.0)
                        await camera_node(c)
                        return True
                    except Exception:
                        return False
                    finally:
                        with suppress(Exception):
                            await c.disconnect()

                return sum(await asyncio.gather(*(one() for _ in range(50))))

            served = asyncio.run(many())
            assert 1 <= served <= 10, served
            after_many = d.wait_status(lambda s: s.opcua is not None and s.opcua.updates >= 10, timeout=60)
            assert after_many.opcua is not None
            assert rss_kb(d.proc.pid) - before < 100_000  # KB: bounded, nowhere near 50 sessions' queues

            async def still() -> str:
                async with client(url(port)) as c:
                    camera, ns = await camera_node(c)
                    return str(await (await camera.get_child(f"{ns}:Verdict")).read_value())

            assert asyncio.run(still()) == "NG"

            async def monitored(asked: list[int]) -> list[list[str]]:
                """What the server answers to items of ``Verdict`` asked for in calls of ``asked`` each."""
                async with client(url(port)) as c:
                    camera, ns = await camera_node(c)
                    verdict = await camera.get_child(f"{ns}:Verdict")
                    sub = await c.create_subscription(60_000, Notifications())
                    answers = []
                    for n in asked:
                        items = [
                            ua.MonitoredItemCreateRequest(
                                ItemToMonitor=ua.ReadValueId(NodeId=verdict.nodeid, AttributeId=ua.AttributeIds.Value),
                                MonitoringMode=ua.MonitoringMode.Reporting,
                                RequestedParameters=ua.MonitoringParameters(ClientHandle=i + 1, QueueSize=1),
                            )
                            for i in range(n)
                        ]
                        params = ua.CreateMonitoredItemsParameters(SubscriptionId=sub.subscription_id, ItemsToCreate=items)
                        answers.append([r.StatusCode.name for r in await c.uaclient.create_monitored_items(params)])
                    await sub.delete()
                    return answers

            # Items by the thousand, each a callback per verdict and about 2 KB: before, all granted.
            first, more = asyncio.run(monitored([1500, 10]))
            assert first == ["Good"] * 1000 + ["BadTooManyMonitoredItems"] * 500
            assert more == ["BadTooManyMonitoredItems"] * 10
            assert d.stop(timeout=20) == 0  # with the stopped client still connected
        finally:
            stopped.kill()
            stopped.wait()
            if stopped.stdout is not None:
                stopped.stdout.close()


@pytest.mark.integration
def test_a_peer_announcing_a_huge_chunk_is_cut_off_not_buffered(tmp_path: Path) -> None:
    port = free_port()
    with running(tmp_path, trigger={"mode": "free"}, inspect={}, opcua={"listen": url(port)}) as d:
        serving(d)
        before = rss_kb(d.proc.pid)
        sent = 0
        with socket.create_connection(("127.0.0.1", port), timeout=30) as peer:
            peer.sendall(b"HELF" + (1 << 30).to_bytes(4, "little"))  # a Hello of 1 GiB, before any session
            piece = bytes(1 << 16)
            with pytest.raises(OSError):  # the server closed the connection: ECONNRESET or EPIPE
                while sent < 200 << 20:
                    peer.sendall(piece)
                    sent += len(piece)
        assert sent < 8 << 20, sent  # cut off within a few reads, not after buffering what it announced
        assert rss_kb(d.proc.pid) - before < 50_000
        d.collect("verdict", 1, timeout=30)  # and the daemon goes on


@pytest.mark.integration
def test_a_reload_keeps_the_server_and_its_sessions_and_new_opcua_settings_restart_it(tmp_path: Path) -> None:
    port = free_port()
    with running(tmp_path, trigger={"mode": "free"}, inspect={}, opcua={"listen": url(port), "max_clients": 10}) as d:
        serving(d)

        async def across_reloads() -> tuple[str, str]:
            async with client(url(port)) as c:
                camera, ns = await camera_node(c)
                sequence = await camera.get_child(f"{ns}:Sequence")
                await written(sequence)
                d.signal(signal.SIGHUP)
                assert await until(lambda: "reloaded: model" in d.log()), d.log()
                reloaded = await sequence.read_value()  # the same session, on the same server
                deadline = time.monotonic() + 60  # and the verdicts after the reload reach it
                while (kept := await sequence.read_value()) <= reloaded and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert kept > reloaded, (reloaded, kept)
            config = tmp_path / "edged.toml"
            config.write_text(config.read_text().replace("max_clients = 10", "max_clients = 5"))
            d.signal(signal.SIGHUP)
            assert await until(lambda: d.log().count(SERVING) == 2), d.log()
            async with client(url(port)) as c:
                camera, ns = await camera_node(c)
                return str(await written(await camera.get_child(f"{ns}:Verdict"))), d.log()

        verdict, log = asyncio.run(across_reloads())
        assert verdict == "NG" and "OPC UA output off" not in log
        assert d.stop() == 0


def test_a_users_file_names_each_user_once_per_line_and_refuses_what_is_not(tmp_path: Path) -> None:
    users = _users(tmp_path)
    assert read_users(users) == {"plc": PASSWORD}
    users.write_text("plc:a:b\n\n  # comment\nscada:pw\n")
    assert read_users(users) == {"plc": "a:b", "scada": "pw"}  # the password is all after the first colon
    for text, problem in (("just-a-name\n", "line 1 of"), (":pw\n", "line 1 of"), ("# none\n", "holds no USER")):
        users.write_text(text)
        with pytest.raises(KeyFileError, match=problem):
            read_users(users)


def test_the_certificate_is_made_once_and_half_a_pair_is_refused(tmp_path: Path) -> None:
    cert, key = server_certificate(tmp_path / "opcua")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "opcua").stat().st_mode) == 0o750
    made = x509.load_der_x509_certificate(cert.read_bytes())
    uris = made.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert application_uri() in uris.get_values_for_type(x509.UniformResourceIdentifier)
    key_id = made.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert made.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier == key_id.digest
    assert server_certificate(tmp_path / "opcua") == (cert, key) and cert.read_bytes() == made.public_bytes(Encoding.DER)
    key.unlink()
    with pytest.raises(KeyFileError, match=re.escape("holds only one of server.der and server.pem")):
        server_certificate(tmp_path / "opcua")


@pytest.mark.parametrize("damage", ["certificate cut short", "key cut short", "key of another pair"])
def test_a_damaged_pair_is_refused_naming_the_file_and_the_way_out(tmp_path: Path, damage: str) -> None:
    # An earlier edged wrote the pair in place: a power cut could leave either cut short, which the
    # OPC UA server then met as it loaded it, and stopped with a traceback.
    cert, key = server_certificate(tmp_path / "opcua")
    if damage == "certificate cut short":
        cert.write_bytes(cert.read_bytes()[:100])
    elif damage == "key cut short":
        key.write_bytes(key.read_bytes()[:200])
    else:
        key.write_bytes(server_certificate(tmp_path / "other")[1].read_bytes())
    damaged = cert if damage.startswith("certificate") else key
    # Said when the configuration loads, so by edged check too:
    assert (cert_dir_problem(tmp_path / "opcua") or "").startswith(f"opcua.cert_dir: {damaged} is not ")
    with pytest.raises(KeyFileError, match=re.escape(f"opcua.cert_dir: {damaged} is not ")) as refused:
        server_certificate(tmp_path / "opcua")
    assert "remove both to have a new pair made at the next start" in str(refused.value)
    assert refused.value.exit_code == EXIT_CONFIG


def test_a_disk_that_takes_no_certificate_leaves_nothing_behind_and_is_no_setup_error(tmp_path: Path) -> None:
    """Before: a KeyFileError (exit 78, not restarted) and an empty key left behind, which the next start,
    the disk freed, refused as half a pair (exit 78 again) until someone removed it."""
    folder = tmp_path / "state"
    with tmpfs(folder, "size=64k") as mounted:
        if not mounted:
            pytest.skip("a small tmpfs needs root and mount")
        fill(folder / "filler")
        with pytest.raises(OutputFileError, match="No space left on device") as refused:
            server_certificate(folder / "opcua")
        assert str(refused.value).startswith(f"opcua.cert_dir: cannot make the server certificate in {folder / 'opcua'}: ")
        assert refused.value.exit_code != EXIT_CONFIG
        assert list((folder / "opcua").iterdir()) == [] and cert_dir_problem(folder / "opcua") is None
        (folder / "filler").unlink()
        assert server_certificate(folder / "opcua") == (folder / "opcua" / CERT_FILE, folder / "opcua" / KEY_FILE)
        assert sorted(p.name for p in (folder / "opcua").iterdir()) == [CERT_FILE, KEY_FILE]


def test_a_power_cut_between_placing_the_certificate_and_its_key_is_finished_at_the_next_start(tmp_path: Path) -> None:
    """Both are on the disk before either is renamed into place, the certificate first: a power cut
    between leaves the key whole beside it, put in place when the configuration loads, not half a pair."""
    made_cert, made_key = server_certificate(tmp_path / "made")
    folder = tmp_path / "opcua"
    folder.mkdir()
    shutil.copy(made_cert, folder / CERT_FILE)
    shutil.copy(made_key, folder / f".server.123-0badcafe.part{Path(KEY_FILE).suffix}")
    assert cert_dir_problem(folder) is None
    cert, key = server_certificate(folder)
    assert cert.read_bytes() == made_cert.read_bytes() and key.read_bytes() == made_key.read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == [CERT_FILE, KEY_FILE]


@needs_faketime
def test_a_certificate_made_on_a_clock_set_ahead_is_valid_once_the_clock_is_right(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A board whose clock reads four years ahead at the first start, then set right: the pair made
    then is still valid now (before: valid from a day before that wrong date, so for four years
    every client that checks the dates refused it). One that the clock reads outside its dates, as
    such a certificate made before was, is said at start with the way out."""
    make = (
        "import sys; from pathlib import Path; from edged.opcua_server import server_certificate as s; s(Path(sys.argv[1]))"
    )
    env = {**os.environ, "LD_PRELOAD": str(FAKETIME), "FAKETIME": "+1460d"}
    subprocess.run([sys.executable, "-c", make, str(tmp_path / "opcua")], env=env, check=True)
    made = x509.load_der_x509_certificate((tmp_path / "opcua" / "server.der").read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    assert made.not_valid_before_utc <= now <= made.not_valid_after_utc, made.not_valid_before_utc
    with caplog.at_level(logging.WARNING, logger="edged.opcua_server"):
        server_certificate(tmp_path / "opcua")
        assert caplog.messages == []
        (tmp_path / "opcua" / "server.der").write_bytes(_dated(now + datetime.timedelta(days=1460), tmp_path / "opcua"))
        server_certificate(tmp_path / "opcua")
    [said] = caplog.messages
    assert "clients that check the dates refuse it" in said and f"Remove it and {tmp_path / 'opcua' / 'server.pem'}" in said


def test_a_certificate_kept_without_key_identifiers_stays_and_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pair made by an edged that added no Subject or Authority Key Identifier, which clients were
    told to trust: kept as it is, and said at start with the way to a new one."""
    server_certificate(tmp_path / "opcua")
    cert = tmp_path / "opcua" / "server.der"
    old = _dated(datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1), tmp_path / "opcua")
    cert.write_bytes(old)
    with caplog.at_level(logging.INFO, logger="edged.opcua_server"):
        server_certificate(tmp_path / "opcua")
    assert cert.read_bytes() == old
    [said] = caplog.messages
    assert "lacks the Subject and Authority Key Identifiers" in said and "Remove it and" in said, said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edged.opcua_server"):
        cert.unlink()
        (tmp_path / "opcua" / "server.pem").unlink()
        server_certificate(tmp_path / "opcua")
        server_certificate(tmp_path / "opcua")  # the new one, kept: nothing to say
    assert [message.split(" (")[0] for message in caplog.messages] == [f"OPC UA: made the server certificate {cert}"]


def _dated(valid_from: datetime.datetime, folder: Path) -> bytes:
    """A certificate over the folder's key, valid from ``valid_from`` for a year, as DER."""
    private = serialization.load_pem_private_key((folder / "server.pem").read_bytes(), None)
    assert isinstance(private, rsa.RSAPrivateKey)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edged@dated")])
    builder = x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
    builder = builder.serial_number(x509.random_serial_number()).not_valid_before(valid_from)
    cert = builder.not_valid_after(valid_from + datetime.timedelta(days=365)).sign(private, hashes.SHA256())
    return cert.public_bytes(Encoding.DER)


def test_a_cert_dir_the_server_cannot_use_is_refused_at_load_as_the_daemon_would(tmp_path: Path) -> None:
    users = _users(tmp_path)
    (tmp_path / "afile").write_text("x")
    half = tmp_path / "half"
    half.mkdir()
    (half / "server.der").write_bytes(b"x")
    for cert_dir, problem in (
        (tmp_path / "afile", "is not a folder"),
        (tmp_path / "afile" / "opcua", "is not a folder"),
        (half, "holds only one of server.der and server.pem"),
    ):
        cfg = OpcuaConfig(listen="opc.tcp://127.0.0.1:4840", users_file=users, cert_dir=cert_dir)
        said = opcua_problems(cfg)
        assert len(said) == 1 and said[0].startswith("opcua.cert_dir: ") and problem in said[0], said
    assert opcua_problems(OpcuaConfig(listen="opc.tcp://127.0.0.1:4840", users_file=users, cert_dir=tmp_path / "new")) == []
    assert opcua_problems(OpcuaConfig(cert_dir=tmp_path / "afile")) == []  # no users_file: no certificate


class Said(logging.Handler):
    """The records edged's own handlers (the root logger's) get."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_asyncua_says_each_thing_at_most_once_a_minute_and_nothing_below_warnings() -> None:
    # Read at the root logger, not with caplog: pytest hangs its capture on every logger that does
    # not propagate, as asyncua's does once another test in this process has made a server.
    quiet_asyncua()
    quiet_asyncua()  # a second server adds no second handler
    noisy = logging.getLogger("asyncua.server.binary_server_asyncio")
    root, said_to = logging.getLogger(), Said()
    root.addHandler(said_to)
    try:
        for peer in range(100):
            noisy.warning("Refusing connection from %s: at max_connections=%s", peer, 10)
            noisy.info("New connection from %s", peer)
        noisy.error("Exception raised while processing message from client")
    finally:
        root.removeHandler(said_to)
    said = [record.getMessage() for record in said_to.records if record.name.startswith("asyncua")]
    assert said == [
        "Refusing connection from 0: at max_connections=10",
        "Exception raised while processing message from client",
    ]


def test_a_service_fault_answering_a_client_is_a_warning_and_the_servers_own_failures_stay_errors() -> None:
    """asyncua logs each service fault at error: a wrong password would page whoever alerts on errors."""
    bounded, root, said_to = BoundedLog(), logging.getLogger(), Said()
    processor = logging.getLogger("asyncua.server.uaprocessor")
    fault = "sending service fault response: %s (%s)"

    def record(level: int, msg: str, *args: str) -> logging.LogRecord:
        return processor.makeRecord(processor.name, level, __file__, 0, msg, args, None)

    root.addHandler(said_to)
    try:
        for _ in range(2):  # each at most once a minute, the warnings not holding back the errors
            bounded.handle(record(logging.ERROR, fault, "User does not have permission", "BadUserAccessDenied"))
            bounded.handle(record(logging.ERROR, fault, "The session id is not valid.", "BadSessionIdInvalid"))
            bounded.handle(record(logging.ERROR, fault, "An internal error occurred", "BadInternalError"))
            bounded.handle(record(logging.ERROR, "Error while processing message"))
    finally:
        root.removeHandler(said_to)
    said = [(record.levelname, record.getMessage()) for record in said_to.records if record.name.startswith("asyncua")]
    assert said == [
        ("WARNING", "sending service fault response: User does not have permission (BadUserAccessDenied)"),
        ("ERROR", "sending service fault response: An internal error occurred (BadInternalError)"),
        ("ERROR", "Error while processing message"),
    ]
    assert [record.levelno for record in said_to.records] == [logging.WARNING, logging.ERROR, logging.ERROR]


def test_a_write_to_an_attribute_the_node_lacks_is_attribute_id_invalid_and_to_one_it_keeps_closed_not_writable() -> None:
    """OPC UA (Part 4, Write) answers each wrong write by what is wrong: no such node, no such attribute
    on the node, an attribute it has but keeps closed. asyncua answered Bad_UserAccessDenied to an
    attribute the node lacks, a right no user lacks there."""
    port = free_port()
    cfg = OpcuaConfig(listen=url(port))
    server = UaServer(cfg, ["cam0"], [], 2.0, lambda: try_listen(cfg.listen))

    async def written() -> dict[str, str]:
        async with client(url(port)) as c:
            camera, ns = await camera_node(c)
            verdict = (await camera.get_child(f"{ns}:Verdict")).nodeid
            text, ids = ua.Variant(ua.LocalizedText("OK")), ua.AttributeIds
            writes = {
                "Verdict's Executable": (verdict, ids.Executable, ua.Variant(True)),
                "camera's ValueRank": (camera.nodeid, ids.ValueRank, ua.Variant(-1, ua.VariantType.Int32)),
                "camera's Value": (camera.nodeid, ids.Value, ua.Variant("OK")),
                "no attribute of OPC UA's": (verdict, 99, ua.Variant("OK")),
                "Verdict's Value": (verdict, ids.Value, ua.Variant("OK")),
                "Verdict's DisplayName": (verdict, ids.DisplayName, text),
                "unknown node's Executable": (ua.NodeId("cam0.Nothing", ns), ids.Executable, ua.Variant(True)),
            }
            params = ua.WriteParameters(
                NodesToWrite=[
                    ua.WriteValue(node, attribute, Value=ua.DataValue(value)) for node, attribute, value in writes.values()
                ]
            )
            results = await c.uaclient.write(params)
            return {label: result.name for label, result in zip(writes, results, strict=True)}

    try:
        assert wait_for(lambda: server.serving, 60)
        assert asyncio.run(written()) == {
            "Verdict's Executable": "BadAttributeIdInvalid",
            "camera's ValueRank": "BadAttributeIdInvalid",
            "camera's Value": "BadAttributeIdInvalid",
            "no attribute of OPC UA's": "BadAttributeIdInvalid",
            "Verdict's Value": "BadNotWritable",
            "Verdict's DisplayName": "BadNotWritable",
            "unknown node's Executable": "BadNodeIdUnknown",
        }
    finally:
        server.close()


def test_a_stop_with_a_client_subscribed_logs_no_error_and_no_client_gone() -> None:
    """A stop (or a reload that restarts the server) while a client held its session and a
    subscription left their tasks pending on the closed loop, each an ERROR ("Task was destroyed
    but it is pending!") in the log of a clean stop, and said the client went away when edged had
    closed its connection."""
    port = free_port()
    cfg = OpcuaConfig(listen=url(port))
    server = UaServer(cfg, ["cam0"], [], 2.0, lambda: try_listen(cfg.listen))
    subscribed, stopped = threading.Event(), threading.Event()

    async def subscriber() -> None:
        c = client(url(port))
        await c.connect()
        camera, ns = await camera_node(c)
        subscription = await c.create_subscription(50, Notifications())
        await subscription.subscribe_data_change(await camera.get_child(f"{ns}:State"))
        subscribed.set()
        await until(stopped.is_set)

    holding = threading.Thread(target=asyncio.run, args=(subscriber(),), daemon=True)
    root, said_to = logging.getLogger(), Said()
    root.addHandler(said_to)
    try:
        assert wait_for(lambda: server.serving, 60)
        holding.start()
        assert subscribed.wait(30)
        server.close()
        gc.collect()  # a task left pending is said when it is collected
    finally:
        stopped.set()
        holding.join(30)
        root.removeHandler(said_to)
    said = [r.getMessage() for r in said_to.records if r.name in ("asyncio", "edged.opcua_server")]
    assert not [m for m in said if "pending" in m or "went away" in m], said


def test_check_says_who_may_sign_in_and_where_the_certificate_is(tmp_path: Path) -> None:
    users = _users(tmp_path)
    cfg = OpcuaConfig(listen="opc.tcp://0.0.0.0:4840", users_file=users, cert_dir=tmp_path / "opcua")
    settings = Settings(model={"path": tmp_path / "m.onnx"}, inspect={}, opcua=cfg)
    said = describe(cfg, settings)
    assert said == (
        f"opc.tcp://0.0.0.0:4840: verdicts of cam0; Basic256Sha256 SignAndEncrypt, 1 user(s) of {users}; "
        f"certificate {tmp_path / 'opcua' / 'server.der'}, made on the first start"
    )
    server_certificate(tmp_path / "opcua")
    assert describe(cfg, settings).endswith("server.der")


def test_off_loopback_needs_a_users_file_and_loopback_does_not() -> None:
    assert OpcuaConfig().listen == "opc.tcp://127.0.0.1:4840" and not OpcuaConfig().secured
    assert OpcuaConfig(listen="opc.tcp://[::1]:4841/edged").users_file is None
    with pytest.raises(ValueError, match=re.escape("is not a loopback address: set opcua.users_file")):
        OpcuaConfig(listen="opc.tcp://192.168.1.20:4840")
    assert OpcuaConfig(listen="opc.tcp://0.0.0.0:4840", users_file=Path("/etc/edged/opcua.users")).secured
    for bad, problem in (
        ("tcp://127.0.0.1:4840", "is not opc.tcp://HOST:PORT"),
        ("opc.tcp://127.0.0.1", "is not HOST:PORT"),
        ("opc.tcp://plc-gateway:4840", "binds an address, not a name"),
    ):
        with pytest.raises(ValueError, match=re.escape(problem)):
            OpcuaConfig(listen=bad)


STALLED = """
import asyncio, sys
from asyncua import Client
class Quiet:
    def datachange_notification(self, node, val, data): pass
async def main():
    c = Client(sys.argv[1], timeout=30)
    await c.connect()
    ns = await c.get_namespace_index("urn:edged")
    node = await c.nodes.objects.get_child([f"{ns}:edged", f"{ns}:cam0", f"{ns}:LastMessage"])
    sub = await c.create_subscription(10, Quiet())
    await sub.subscribe_data_change(node, queuesize=100)
    print("subscribed", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@pytest.mark.integration
def test_a_reload_that_restarts_the_server_carries_counts_last_verdict_state_and_what_the_journal_held(
    tmp_path: Path,
) -> None:
    port = free_port()
    doc = inspecting(tmp_path, opcua={"listen": url(port), "max_clients": 10})
    settings = load_config(write_config(tmp_path / "edged.toml", doc))
    doc["opcua"]["max_clients"] = 5
    restarted = load_config(write_config(tmp_path / "edged.toml", doc))
    model = load_model(settings.model, settings.runtime)
    outputs = Outputs(settings, Services(lambda: None, threading.Event()))
    journal, old = outputs.get(JournalOutput), outputs.get(OpcuaOutput)
    assert journal is not None and old is not None
    try:
        assert wait_for(lambda: old.server.serving, 60)
        old.frame(ng_report(model, "cam0", 0))
        journal.deliver_recorded()  # verdict 0 recorded: the server has it
        assert wait_for(lambda: old.server.updates == 1, 10)
        old.frame(ng_report(model, "cam0", 1))  # verdict 1 still held by the journal when the reload comes
        old.status([StatusReport((camera_status(), {}, None), b"")])  # the camera is lost
        outputs.reload(restarted)  # the daemon's reload: the server restarts
        new = outputs.get(OpcuaOutput)
        assert new is not None and new is not old
        assert wait_for(lambda: new.server.serving, 60)

        async def read() -> list[tuple[int, int, str]]:
            async with client(url(port)) as c:
                camera, ns = await camera_node(c)
                nodes = [await camera.get_child(f"{ns}:{name}") for name in ("Sequence", "NgCount", "State")]

                async def values() -> tuple[int, int, str]:
                    return (await written(nodes[0]), await nodes[1].read_value(), await nodes[2].read_value())

                first = await values()  # the new server's first values: verdict 0, counts since start, the state
                journal.deliver_recorded()
                deadline = time.monotonic() + 60
                while (then := await values()) == first and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return [first, then]

        assert asyncio.run(read()) == [(0, 1, "lost"), (1, 2, "lost")]
        assert wait_for(lambda: new.server.updates == 2, 10)  # since start: verdict 1 here, verdict 0 on the server replaced
    finally:
        outputs.close()
