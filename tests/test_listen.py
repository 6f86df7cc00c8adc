"""The sockets the daemon binds, against hostile peers: real daemons, raw TCP peers, real SUB sockets."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from daemon import RunningDaemon, free_port, rss_kb, run_cli, write_config, write_video
from onnx_models import colour_probe
from waiting import wait_for

from edged.errors import BindError
from edged.listen import retry_bind, try_bind
from edged.messages import DetectionsMessage
from edged.subscribe import Subscriber

pytestmark = pytest.mark.integration

MiB = 1 << 20
RSS_SLACK_KB = 48 * 1024  # the attacks below would add hundreds of MB each


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    colour_probe(tmp_path / "probe.onnx")
    write_video(tmp_path / "clip.avi", [(0, 0, 255), (255, 0, 0)] * 20)
    return tmp_path


def _config(workdir: Path, endpoint: str, source: dict[str, object] | None = None) -> Path:
    return write_config(
        workdir / "edged.toml",
        {
            "source": source or {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
            "thermal": {"enabled": False},
        },
    )


@pytest.fixture
def tcp_daemon(workdir: Path) -> Iterator[RunningDaemon]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = RunningDaemon(_config(workdir, endpoint), endpoint)
    yield d
    d.close()


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _zmtp_sub_peer(port: int) -> socket.socket:
    """A raw TCP peer that speaks ZMTP 3.0 as a SUB socket up to the first message."""
    peer = socket.create_connection(("127.0.0.1", port), timeout=10)
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)
    ready = b"\x05READY" + b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
    peer.sendall(greeting + bytes([0x04, len(ready)]) + ready)
    return peer


def _stream_a_huge_message(port: int, declared: int, send_at_most: int) -> int:
    """Declare one ``declared``-byte message, then send its body; returns how much got through."""
    chunk, sent = bytes(MiB), 0
    with _zmtp_sub_peer(port) as peer:
        try:
            peer.sendall(b"\x02" + declared.to_bytes(8, "big"))  # a long, final message frame
            while sent < send_at_most:
                peer.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
    return sent


@pytest.mark.parametrize("socket_type", [zmq.XPUB, zmq.ROUTER, zmq.REP])
def test_a_trial_bind_is_released_before_its_release_returns(socket_type: int) -> None:
    """``edged check`` binds each endpoint and lets go of it: a port still held by libzmq's I/O
    thread after the release would refuse whoever binds it next (the daemon, or the next check)."""
    port = free_port()
    for _ in range(20):
        try_bind(f"tcp://127.0.0.1:{port}", "publish.endpoints", socket_type)()
        with socket.socket() as peer, pytest.raises(ConnectionRefusedError):
            peer.connect(("127.0.0.1", port))


# Listeners made and bound with 0 to 9 descriptors to spare, each on a fresh context; prints what each did.
AT_THE_LIMIT = """
import errno, os, resource, zmq
from edged.listen import Listener

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
for room in range(10):
    context, listener = zmq.Context(), None
    lowest_free = next(fd for fd in range(1 << 20) if not os.path.exists(f"/proc/self/fd/{fd}"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free + room, hard))
    try:
        listener = Listener(context, zmq.XPUB, lambda sock: None, "publish.endpoints")
        listener.bind("tcp://127.0.0.1:*")
        print("bound")
    except (OSError, zmq.ZMQError) as e:
        print(errno.errorcode[e.errno])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if listener is not None:
            listener.close(linger=0)
        context.term()
"""


def test_a_listener_short_of_descriptors_fails_with_emfile_and_never_aborts() -> None:
    """libzmq aborts the process (an assertion, exit 134) where it cannot open a descriptor of its own,
    as its I/O thread's poller or its bind's interface lookup: edged, started with a unit's
    LimitNOFILE= too low, died so instead of saying why. A listener is made and bound only with room."""
    done = subprocess.run([sys.executable, "-c", AT_THE_LIMIT], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    outcomes = done.stdout.split()
    assert len(outcomes) == 10, done.stdout
    assert outcomes[0] == "EMFILE" and outcomes[-1] == "bound", outcomes
    assert set(outcomes) == {"EMFILE", "bound"}, outcomes


def test_a_trial_bind_of_an_ipc_path_leaves_no_socket_file_and_a_live_one_alone(tmp_path: Path) -> None:
    """libzmq leaves an ipc socket file behind. One left by ``sudo edged check`` is root's, in the
    service's runtime directory, where the service cannot tell whether anyone listens: its next start
    failed there."""
    path = tmp_path / "detections.sock"
    try_bind(f"ipc://{path}", "publish.endpoints", zmq.XPUB)()
    assert not os.path.lexists(path)
    with zmq.Context() as context, context.socket(zmq.XPUB) as live:
        live.bind(f"ipc://{path}")
        with pytest.raises(BindError, match="another process is listening"):
            try_bind(f"ipc://{path}", "publish.endpoints", zmq.XPUB)
        assert path.is_socket()


def test_the_folders_a_trial_bind_made_are_removed_unless_given_to_the_service_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sudo edged check`` removes the runtime directory it made for an ipc socket, but not one systemd
    gave the service's user meanwhile (the service started while check ran): that one was removed too,
    and the service, which may not make it again, could bind no socket there."""
    runtime = tmp_path / "run" / "edged"
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(runtime))
    endpoint = f"ipc://{runtime}/detections.sock"
    try_bind(endpoint, "publish.endpoints", zmq.XPUB)()
    assert not (tmp_path / "run").exists()
    if os.geteuid() != 0:
        pytest.skip("only root gives a folder to another user")
    release = try_bind(endpoint, "publish.endpoints", zmq.XPUB)
    os.chown(runtime, 65534, 65534)  # as systemd gives RuntimeDirectory= to the service's user at its start
    release()
    assert runtime.is_dir() and (runtime.stat().st_uid, os.listdir(runtime)) == (65534, [])


def test_a_peer_declaring_a_huge_message_is_cut_off_and_memory_stays_flat(tcp_daemon: RunningDaemon) -> None:
    tcp_daemon.collect("detections", 10)
    rss_before = rss_kb(tcp_daemon.proc.pid)
    for _ in range(3):
        sent = _stream_a_huge_message(_port(tcp_daemon.endpoint), declared=1 << 30, send_at_most=128 * MiB)
        assert sent < 32 * MiB, f"the daemon read {sent // MiB} MiB of one message"
    tcp_daemon.collect("detections", 10)  # still publishing to its subscriber
    assert rss_kb(tcp_daemon.proc.pid) - rss_before < RSS_SLACK_KB


# A SUB socket holding a 20 MB subscription crashes its own process when it is closed (SIGSEGV
# in libzmq 4.3.5), so each one runs in a child that reports and exits without closing it.
HUGE_SUBSCRIBER = """
import os, sys, zmq
from zmq.utils.monitor import recv_monitor_message
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.RECONNECT_IVL, 60_000)  # one attempt is the measurement
sub.setsockopt(zmq.SUBSCRIBE, b"edged/" + bytes(20 * 1000 * 1000))
monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
sub.connect(sys.argv[1])
cut_off = monitor.poll(60_000) and recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
print("cut off" if cut_off else "kept", flush=True)
os._exit(0)
"""


def test_huge_subscriptions_are_cut_off_and_memory_stays_flat(tcp_daemon: RunningDaemon) -> None:
    tcp_daemon.collect("detections", 10)
    rss_before = rss_kb(tcp_daemon.proc.pid)
    peers = [
        subprocess.Popen([sys.executable, "-c", HUGE_SUBSCRIBER, tcp_daemon.endpoint], stdout=subprocess.PIPE, text=True)
        for _ in range(2)  # had it been stored: a trie node per byte, over a GB between them
    ]
    try:
        for peer in peers:
            out, _ = peer.communicate(timeout=90)
            assert out.strip() == "cut off", tcp_daemon.log()
        tcp_daemon.collect("detections", 10)
        assert rss_kb(tcp_daemon.proc.pid) - rss_before < RSS_SLACK_KB
    finally:
        for peer in peers:
            peer.kill()
            peer.wait()


# Connection after connection, each with 100 distinct ~1 KB subscriptions that match no topic of
# edged, until 20,000 are sent; a connection ends when the daemon cuts it off. Stored by libzmq,
# they would take the daemon's trie to about 900 MB.
MANY_SUBSCRIPTIONS = """
import sys, zmq
endpoint, total = sys.argv[1], int(sys.argv[2])
context = zmq.Context()
sent = cut_off = 0
while sent < total:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SNDHWM, 0)  # queue every subscription, however many
    monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sub.connect(endpoint)
    for _ in range(100):
        sub.setsockopt(zmq.SUBSCRIBE, b"edged/%08d/" % sent + bytes(990))  # within the message-size limit
        sent += 1
    cut_off += bool(monitor.poll(30_000))
    sub.disable_monitor()
    monitor.close(linger=0)
    sub.close(linger=0)
print(sent, cut_off, flush=True)
"""


def test_thousands_of_subscriptions_that_match_nothing_leave_memory_flat(tcp_daemon: RunningDaemon) -> None:
    honest = Subscriber(tcp_daemon.endpoint, "edged/detections/")
    try:
        assert isinstance(honest.receive(20), DetectionsMessage)
        tcp_daemon.collect("detections", 10)
        rss_before = rss_kb(tcp_daemon.proc.pid)
        peer = subprocess.Popen(
            [sys.executable, "-c", MANY_SUBSCRIPTIONS, tcp_daemon.endpoint, "6000"], stdout=subprocess.PIPE, text=True
        )
        try:
            out, _ = peer.communicate(timeout=120)
        finally:
            peer.kill()
            peer.wait()
        sent, cut_off = map(int, out.split())
        assert sent == 6_000 and cut_off > 0, tcp_daemon.log()
        # 6 MB of subscriptions read and refused: stored, they would be ~130 MB of trie, past the slack.
        status = tcp_daemon.wait_status(lambda m: m.drops.get("subscription_refused", 0) >= 3_000)
        assert rss_kb(tcp_daemon.proc.pid) - rss_before < RSS_SLACK_KB, status.drops
        assert isinstance(honest.receive(20), DetectionsMessage)  # reconnected and subscribed again by itself
        assert "bound afresh, so every subscriber reconnects" in tcp_daemon.log()
    finally:
        honest.close()


def _receive(sub: zmq.Socket[bytes], timeout_s: float = 20) -> bytes:
    assert sub.poll(int(timeout_s * 1000)), "nothing received"
    return sub.recv_multipart()[0]


def test_honest_subscriptions_get_the_topics_they_match_and_unsubscribing_stops_them(tcp_daemon: RunningDaemon) -> None:
    detections, status = b"edged/detections/cam0", b"edged/status/cam0"
    filters = [b"", b"edged/", b"edged/detections/", b"edged/status/cam0", b"edged/detections/cam9", b"other/"]
    context = zmq.Context()
    subs = []
    for topic in filters:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(tcp_daemon.endpoint)
        subs.append(sub)
    try:
        tcp_daemon.wait_status(lambda m: m.frames_processed >= 10)
        expected = [{detections, status}, {detections, status}, {detections}, {status}]
        for topic, sub, wanted in zip(filters[:4], subs[:4], expected, strict=True):
            seen: set[bytes] = set()
            while seen != wanted:  # every topic it matches, and only those
                seen.add(_receive(sub))
                assert seen <= wanted, (topic, seen)
        assert not subs[4].poll(0) and not subs[5].poll(0)  # another camera's topic, another prefix
        # Unsubscribing from detections, then subscribing to status: once a status message arrives
        # the daemon has applied both, in order, and no detection may follow it.
        switching = subs[2]
        switching.setsockopt(zmq.UNSUBSCRIBE, b"edged/detections/")
        switching.setsockopt(zmq.SUBSCRIBE, b"edged/status/")
        while _receive(switching) != status:
            pass
        assert {_receive(switching) for _ in range(3)} == {status}
        refused = tcp_daemon.wait_status(lambda m: True).drops.get("subscription_refused", 0)
        assert refused == 2, refused
        assert "bound afresh" not in tcp_daemon.log()
    finally:
        for sub in subs:
            sub.close(linger=0)
        context.term()


def test_a_subscriber_to_the_camera_a_reload_switches_to_gets_its_messages(workdir: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = _config(workdir, endpoint)
    d = RunningDaemon(config, endpoint)
    waiting = Subscriber(endpoint, "edged/detections/cam1")
    try:
        refused = d.wait_status(lambda m: m.drops.get("subscription_refused", 0) >= 1)
        assert refused.camera_id == "cam0"
        source = {"type": "file", "path": "clip.avi", "loop": True, "realtime": True, "camera_id": "cam1"}
        _config(workdir, endpoint, source)
        d.signal(signal.SIGHUP)
        msg = waiting.receive(30)
        assert isinstance(msg, DetectionsMessage) and msg.camera_id == "cam1", d.log()
    finally:
        waiting.close()
        d.close()


def test_out_of_descriptors_edged_keeps_its_subscribers_and_says_so_once(workdir: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    source = {"type": "synthetic", "width": 128, "height": 96, "fps": 20.0}  # reopens no file
    d = RunningDaemon(_config(workdir, endpoint, source), endpoint)
    idle: list[socket.socket] = []
    refusing, again = "new connections wait unaccepted: Too many open files", "accepting connections again"
    try:
        d.wait_status(lambda m: m.frames_processed >= 5)  # steady state: all it needs is open and imported
        in_use = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)[1]
        resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (in_use + 8, hard))
        idle = [socket.create_connection(("127.0.0.1", _port(endpoint)), timeout=10) for _ in range(100)]
        assert wait_for(lambda: refusing in d.log(), 30), d.log()
        d.collect("detections", 20)  # the subscriber it had still gets everything
        assert d.log().count(refusing) == 1 and again not in d.log()
        for sock in idle:
            sock.close()
        assert wait_for(lambda: again in d.log(), 30), d.log()
        late = Subscriber(endpoint, "edged/detections/")
        try:
            assert isinstance(late.receive(20), DetectionsMessage)
        finally:
            late.close()
        assert d.log().count(refusing) == 1
        assert d.stop() == 0
    finally:
        for sock in idle:
            sock.close()
        d.close()


def test_a_second_daemon_on_the_same_ipc_path_is_refused_and_the_first_keeps_it(workdir: Path) -> None:
    (workdir / "run").mkdir()
    endpoint = f"ipc://{workdir}/run/detections.sock"
    config = _config(workdir, endpoint)
    first = RunningDaemon(config, endpoint)
    try:
        first.collect("detections", 5)
        second = run_cli("run", "--config", str(config), timeout=60)
        assert second.returncode == 1, second.stderr  # like a tcp port in use: systemd may retry
        assert f"another process is listening on {workdir}/run/detections.sock" in second.stderr
        first.collect("detections", 5)
        assert first.stop() == 0
    finally:
        first.close()


def test_an_ipc_folder_is_made_only_under_the_runtime_directory(workdir: Path) -> None:
    # As root, edged made whatever folder an ipc path named: a typo created /nonexistent/dir.
    runtime = workdir / "run"
    env = {"RUNTIME_DIRECTORY": str(runtime)}
    missing = workdir / "nonexistent" / "dir"
    endpoint = f"ipc://{missing}/detections.sock"
    config = _config(workdir, endpoint)
    for command in ("check", "run"):
        refused = run_cli(command, "--config", str(config), env=env)
        assert refused.returncode == 78, (command, refused.stderr)
        problem = f"publish.endpoints: {endpoint}: the folder {missing} does not exist, and edged makes folders only"
        assert problem in refused.stderr and str(runtime) in refused.stderr, (command, refused.stderr)
    assert not (workdir / "nonexistent").exists()
    endpoint = f"ipc://{runtime}/line3/detections.sock"
    d = RunningDaemon(_config(workdir, endpoint), endpoint, env=env)
    try:
        d.collect("detections", 2)
        assert d.stop() == 0
    finally:
        d.close()


@pytest.mark.unit
def test_a_taken_address_is_tried_again_said_once_and_given_up_when_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("edged.listen.BIND_RETRY_S", 0.01)
    tries: list[int] = []
    said: list[Exception] = []

    async def run(free_at: int | None) -> int | None:
        stop = asyncio.Event()

        async def attempt() -> int:
            tries.append(1)
            if free_at is None or len(tries) < free_at:
                if len(tries) == 5:
                    stop.set()  # closed while the address is still taken
                raise BindError("taken")
            return len(tries)

        return await retry_bind(attempt, stop, said.append)

    assert asyncio.run(run(free_at=3)) == 3 and len(said) == 1
    tries.clear()
    said.clear()
    assert asyncio.run(run(free_at=None)) is None and len(tries) == 5 and len(said) == 1
