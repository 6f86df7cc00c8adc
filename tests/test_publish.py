"""The publisher over real ZeroMQ sockets: fan-out, never blocking, exposure rules, ipc permissions."""

from __future__ import annotations

import contextlib
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from waiting import wait_for
from zmq.utils.monitor import recv_monitor_message

from edged.config import PublishConfig
from edged.errors import PublishError
from edged.listen import MAX_MESSAGE_BYTES
from edged.publish import Publisher, check_exposure, detections_topic
from edged.subscribe import Subscriber


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def subscribe(context: zmq.Context) -> Iterator[Callable[..., zmq.Socket]]:
    """Makes SUB sockets and closes every one of them at teardown."""
    made: list[zmq.Socket] = []

    def make(endpoint: str, topic: bytes = b"") -> zmq.Socket:
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, topic)
        sock.connect(endpoint)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(linger=0)


def _publisher(context: zmq.Context, **cfg: object) -> Publisher:
    return Publisher(PublishConfig(endpoints=["tcp://127.0.0.1:*"], **cfg), ["cam0"], context)  # type: ignore[arg-type]


def _send_until_received(pub: Publisher, subs: list[zmq.Socket], topic: bytes) -> None:
    """PUB/SUB joins asynchronously: send until every subscriber has one message."""
    pending = set(range(len(subs)))
    deadline = time.monotonic() + 5
    while pending and time.monotonic() < deadline:
        pub.send(topic, b"{}")
        for i in list(pending):
            if subs[i].poll(20):
                subs[i].recv_multipart()
                pending.discard(i)
    assert not pending, "subscribers never joined"
    for sub in subs:  # drop the join messages still in flight
        while sub.poll(50):
            sub.recv_multipart()


@contextlib.contextmanager
def _watched(peer: zmq.Socket, endpoint: str) -> Iterator[zmq.Socket]:
    """Connect ``peer`` with a monitor of its disconnections, watching before it connects; closes both."""
    monitor = peer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    peer.connect(endpoint)
    try:
        yield monitor
    finally:
        peer.disable_monitor()
        monitor.close(linger=0)
        peer.close(linger=0)


def test_every_subscriber_gets_topic_and_payload(context: zmq.Context, subscribe: Callable[..., zmq.Socket]) -> None:
    pub = _publisher(context)
    topic = detections_topic("edged", "cam0")
    subs = [subscribe(pub.endpoints[0], b"edged/detections/") for _ in range(3)]
    _send_until_received(pub, subs, topic)
    assert pub.send(topic, b'{"n": 1}')
    for sub in subs:
        assert sub.poll(2000)
        assert sub.recv_multipart() == [b"edged/detections/cam0", b'{"n": 1}']
    pub.close()


def test_the_subscribers_waiting_are_heard_so_the_first_message_reaches_each(context: zmq.Context) -> None:
    """`Publisher.hear_waiting`: what a source that ends sends first reaches the subscribers that
    connected before it, with no join messages sent until they have; nobody waiting costs the wait."""
    pub = _publisher(context)
    topic = detections_topic("edged", "cam0")
    subs = []
    for prefix in (b"edged/detections/", b"edged/"):
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, prefix)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(pub.endpoints[0])
        assert monitor.poll(5000)  # connected: its subscription is on its way
        sub.disable_monitor()
        monitor.close(linger=0)
        subs.append(sub)
    assert pub.hear_waiting(10.0) == 2
    assert pub.send(topic, b'{"n": 1}')
    for sub in subs:
        assert sub.poll(2000)
        assert sub.recv_multipart() == [b"edged/detections/cam0", b'{"n": 1}']
        sub.close(linger=0)
    pub.close()
    assert _publisher(context).hear_waiting(0.05) == 0


def test_topic_filter_separates_status_from_detections(context: zmq.Context, subscribe: Callable[..., zmq.Socket]) -> None:
    pub = _publisher(context)
    status_only = subscribe(pub.endpoints[0], b"edged/status/")
    _send_until_received(pub, [status_only], b"edged/status/cam0")
    pub.send(b"edged/detections/cam0", b"{}")
    pub.send(b"edged/status/cam0", b'{"s": 1}')
    assert status_only.poll(2000)
    assert status_only.recv_multipart()[0] == b"edged/status/cam0"
    assert not status_only.poll(100)
    pub.close()


def test_a_subscriber_that_never_reads_does_not_block_or_queue_without_bound(
    context: zmq.Context, subscribe: Callable[..., zmq.Socket]
) -> None:
    pub = _publisher(context, hwm=4)
    stalled = subscribe(pub.endpoints[0])
    _send_until_received(pub, [stalled], b"t")
    payload = b"x" * 4096
    started = time.monotonic()
    for _ in range(20_000):
        pub.send(b"t", payload)
    elapsed = time.monotonic() - started
    assert pub.sent >= 20_000
    assert elapsed < 10, "sending must never wait for a subscriber"
    received = 0
    while stalled.poll(200):
        stalled.recv_multipart()
        received += 1
    # Only what fits the HWMs on both sides (and the kernel buffers) is ever queued for it.
    assert received < 5_000
    pub.close()


def test_non_loopback_tcp_needs_explicit_insecure() -> None:
    with pytest.raises(PublishError, match="unencrypted"):
        check_exposure("tcp://0.0.0.0:5556", insecure=False)
    with pytest.raises(PublishError, match=r"publish\.insecure"):
        check_exposure("tcp://*:5556", insecure=False)
    check_exposure("tcp://0.0.0.0:5556", insecure=True)
    check_exposure("tcp://127.0.0.1:5556", insecure=False)
    check_exposure("tcp://[::1]:5556", insecure=False)
    check_exposure("ipc:///run/edged/x.sock", insecure=False)


def test_address_in_use_is_a_clear_error(context: zmq.Context, subscribe: Callable[..., zmq.Socket]) -> None:
    first = _publisher(context)
    with pytest.raises(PublishError, match=r"cannot bind .*Address already in use.* \(another program holds it"):
        Publisher(PublishConfig(endpoints=[first.endpoints[0]]), ["cam0"], context)
    first.close()


def test_ipc_socket_is_limited_to_the_group(context: zmq.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "run" / "edged"))
    path = tmp_path / "run" / "edged" / "det.sock"
    pub = Publisher(PublishConfig(endpoints=[f"ipc://{path}"]), ["cam0"], context)
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode == 0o660
    sub = Subscriber(f"ipc://{path}", context=context)
    deadline = time.monotonic() + 5
    while sub.stats.rejected == 0 and time.monotonic() < deadline:
        pub.send(b"edged/status/cam0", b"not json")
        assert sub.receive(0.05) is None  # invalid payloads are counted, never returned
    assert sub.stats.rejected >= 1 and "not JSON" in (sub.stats.last_error or "")
    sub.close()
    pub.close()


def test_close_returns_within_linger_with_messages_queued(
    context: zmq.Context, subscribe: Callable[..., zmq.Socket]
) -> None:
    pub = _publisher(context, linger_ms=100)
    stalled = subscribe(pub.endpoints[0])
    _send_until_received(pub, [stalled], b"t")
    for _ in range(1000):
        pub.send(b"t", b"y" * 1024)
    started = time.monotonic()
    pub.close()
    assert time.monotonic() - started < 2


def test_a_live_ipc_listener_is_refused_and_a_stale_socket_file_replaced(
    context: zmq.Context, subscribe: Callable[..., zmq.Socket], tmp_path: Path
) -> None:
    path = tmp_path / "det.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a crash leaves the file behind with nobody listening
    stale.close()
    first = Publisher(PublishConfig(endpoints=[f"ipc://{path}"]), ["cam0"], context)
    try:
        with pytest.raises(PublishError, match=f"cannot bind ipc://{path}: another process is listening on {path}"):
            Publisher(PublishConfig(endpoints=[f"ipc://{path}"]), ["cam0"], context)
        _send_until_received(first, [subscribe(f"ipc://{path}")], b"t")  # the first one still owns the path
    finally:
        first.close()


def test_a_subscription_beyond_the_size_limit_is_cut_off_and_others_are_served(
    context: zmq.Context, subscribe: Callable[..., zmq.Socket]
) -> None:
    pub = Publisher(PublishConfig(endpoints=["tcp://127.0.0.1:*"], topic_prefix="p" * 256), ["c" * 64], context)
    longest_topic = detections_topic("p" * 256, "c" * 64)  # what the config allows at most
    assert len(longest_topic) + 1 < MAX_MESSAGE_BYTES
    normal = subscribe(pub.endpoints[0], longest_topic)
    hostile = context.socket(zmq.SUB)
    hostile.setsockopt(zmq.SUBSCRIBE, b"x" * (MAX_MESSAGE_BYTES + 1))
    try:
        with _watched(hostile, pub.endpoints[0]) as monitor:
            assert monitor.poll(10_000), "the publisher kept a peer that sent an oversized subscription"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            _send_until_received(pub, [normal], longest_topic)
    finally:
        pub.close()


def test_a_peer_that_sends_a_message_instead_of_a_subscription_cuts_everyone_off_and_they_come_back(
    context: zmq.Context, subscribe: Callable[..., zmq.Socket]
) -> None:
    pub = _publisher(context)
    topic = detections_topic("edged", "cam0")
    honest = subscribe(pub.endpoints[0], b"edged/detections/")
    _send_until_received(pub, [honest], topic)
    hostile = context.socket(zmq.XSUB)
    try:
        with _watched(hostile, pub.endpoints[0]) as monitor:
            hostile.send(b"\x02not a subscription")  # libzmq would hand it up without its peer
            assert wait_for(lambda: bool(pub.send(topic, b"{}")) and monitor.poll(0), 10), "the peer was kept"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert pub.drops["subscription_refused"] == 1
            _send_until_received(pub, [honest], topic)  # it reconnected and subscribed again
    finally:
        pub.close()


def test_subscriptions_to_another_camera_are_refused_until_the_camera_becomes_it(
    context: zmq.Context, subscribe: Callable[..., zmq.Socket]
) -> None:
    pub = _publisher(context)
    everything = subscribe(pub.endpoints[0])
    cam1 = subscribe(pub.endpoints[0], detections_topic("edged", "cam1"))
    _send_until_received(pub, [everything], detections_topic("edged", "cam0"))
    assert wait_for(lambda: bool(pub.send(b"edged/status/cam0", b"{}")) and pub.drops["subscription_refused"] == 1, 10)
    pub.send(detections_topic("edged", "cam1"), b"{}")  # nothing sends it before the camera changes
    assert not cam1.poll(200)
    pub.follow_cameras(["cam1"])
    _send_until_received(pub, [cam1, everything], detections_topic("edged", "cam1"))
    pub.close()


def test_cameras_added_and_removed_keep_the_socket_unless_a_refused_subscription_wants_an_added_one(
    context: zmq.Context, subscribe: Callable[..., zmq.Socket]
) -> None:
    """A reload that adds and removes cameras leaves a subscriber of a kept camera connected and
    every message reaching it (a socket bound afresh loses those sent while its peers reconnect);
    the socket is bound afresh only for a subscription it refused that an added camera now matches."""
    pub = _publisher(context)
    topic = detections_topic("edged", "cam0")
    kept = context.socket(zmq.SUB)
    kept.setsockopt(zmq.SUBSCRIBE, topic)
    try:
        with _watched(kept, pub.endpoints[0]) as monitor:
            _send_until_received(pub, [kept], topic)
            for n, cameras in enumerate([["cam0", "cam1"], ["cam0"], ["cam2", "cam0"], ["cam0"], ["cam0", "cam1"]]):
                pub.follow_cameras(cameras)
                pub.send(topic, b"%d" % n)
                assert kept.poll(5_000), f"the message sent after cameras became {cameras} was lost"
                assert kept.recv_multipart() == [topic, b"%d" % n]
            assert not monitor.poll(0), "the kept camera's subscriber was cut off"
            late = subscribe(pub.endpoints[0], detections_topic("edged", "cam3"))
            assert wait_for(lambda: bool(pub.send(topic, b"{}")) and pub.drops["subscription_refused"] == 1, 10)
            pub.follow_cameras(["cam0", "cam3"])
            assert monitor.poll(10_000), "the socket was kept, so the refused subscriber never gets cam3"
            _send_until_received(pub, [late], detections_topic("edged", "cam3"))
    finally:
        pub.close()


def test_subscriptions_that_match_nothing_are_refused_and_64_kib_of_them_cut_their_peers_off(
    context: zmq.Context, subscribe: Callable[..., zmq.Socket], caplog: pytest.LogCaptureFixture
) -> None:
    pub = _publisher(context)
    topic = detections_topic("edged", "cam0")
    honest = subscribe(pub.endpoints[0], b"edged/detections/")
    _send_until_received(pub, [honest], topic)
    hostile = context.socket(zmq.SUB)
    hostile.setsockopt(zmq.SNDHWM, 0)
    for i in range(65):  # 65,000 bytes: refused, still under 64 KiB
        hostile.setsockopt(zmq.SUBSCRIBE, b"%06d" % i + bytes(994))
    try:
        with _watched(hostile, pub.endpoints[0]) as monitor:
            assert wait_for(lambda: bool(pub.send(topic, b"{}")) and pub.drops["subscription_refused"] == 65, 10)
            assert not monitor.poll(0)
            hostile.setsockopt(zmq.SUBSCRIBE, b"%06d" % 65 + bytes(994))  # 66,000 bytes
            assert wait_for(lambda: bool(pub.send(topic, b"{}")) and monitor.poll(0), 10), "the peer was kept"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
            assert pub.drops["subscription_refused"] == 66
            _send_until_received(pub, [honest], topic)  # cut off too, it reconnected and subscribed again
            warnings = [r.getMessage() for r in caplog.records if r.name == "edged.publish" and r.levelname == "WARNING"]
            assert sum("refused a subscription" in w for w in warnings) == 1, warnings  # 66 refusals, one line a minute
            assert sum("bound afresh" in w for w in warnings) == 1, warnings  # its own line, not held back by the refusals
    finally:
        pub.close()
