"""One CURVE authenticator (`edged.publish.Authenticator`) serves the publisher's and the trigger
server's sockets, as in the daemon: one allow-list, reloaded once for both, real sockets throughout."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import zmq
from zmq.auth.thread import AuthenticationThread
from zmq.utils.monitor import recv_monitor_message

from edged.config import PublishConfig, TriggerConfig
from edged.keys import ClientKeys, create_key_pair
from edged.publish import Publisher, status_topic
from edged.trigger import TriggerServer

REFUSED_S = 30.0  # how long a refused client may wait for the server's refusal


def _auth_threads() -> int:
    return sum(isinstance(t, AuthenticationThread) for t in threading.enumerate())


def _client(made: list[zmq.Socket[bytes]], kind: int, endpoint: str, keys: ClientKeys) -> zmq.Socket[bytes]:
    """A client socket connected to ``endpoint`` with ``keys``, its handshakes watched (`_refused`)."""
    sock = zmq.Context.instance().socket(kind)
    made.append(sock)
    keys.apply(sock)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    sock.connect(endpoint)
    return sock


def _refused(sock: zmq.Socket[bytes]) -> bool:
    """Whether the server refused ``sock``'s key at a handshake (ZAP status 400) within `REFUSED_S`:
    the event libzmq reports, not a silence that a slow connection would give too."""
    monitor = sock.get_monitor_socket()
    if not monitor.poll(int(REFUSED_S * 1000)):
        return False
    event = recv_monitor_message(monitor)
    return bool(event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and event["value"] == 400)


def _streamed(pub: Publisher, sub: zmq.Socket[bytes], timeout_s: float) -> bool:
    """Publish until ``sub`` receives something (PUB/SUB joins asynchronously), or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.send(status_topic("edged", "cam0"), b"{}")
        if sub.poll(20):
            return True
    return False


def _answered(trigger: TriggerServer, req: zmq.Socket[bytes], timeout_s: float) -> bool:
    """Ask for a camera the server does not have (answered at once), serving as the daemon loop does."""
    deadline = time.monotonic() + timeout_s
    if not req.poll(int(timeout_s * 1000), zmq.POLLOUT):  # a REQ cut off for good has nowhere to send
        return False
    try:  # its connection may be cut between the poll and the send: a blocking send would wait for ever
        req.send(b'{"camera_id": "elsewhere"}', zmq.NOBLOCK)
    except zmq.Again:
        return False
    while time.monotonic() < deadline:
        if zmq.select(trigger.fds, [], [], 0.02)[0]:
            trigger.collect()
        if req.poll(0):
            req.recv()
            return True
    return False


def test_a_key_reloaded_once_is_admitted_and_revoked_on_the_stream_and_the_trigger_socket(tmp_path: Path) -> None:
    server_public, server_secret = create_key_pair(tmp_path / "server", "server")
    client_public, client_secret = create_key_pair(tmp_path / "line3", "line3")
    clients = tmp_path / "clients"
    clients.mkdir()
    keys = ClientKeys.from_files(server_public, client_secret)
    publish = PublishConfig(endpoints=["tcp://127.0.0.1:*"], curve_server_key=server_secret, curve_clients_dir=clients)
    before = _auth_threads()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    made: list[zmq.Socket[bytes]] = []  # the clients' sockets
    pub = Publisher(publish, ["cam0"], context)
    trigger = TriggerServer(TriggerConfig(mode="request", endpoint="tcp://127.0.0.1:*"), publish, ["cam0"], pub.auth)
    try:
        assert _auth_threads() == before + 1  # one ZAP handler for both sockets
        stream, trigger_endpoint = pub.endpoints[0], trigger.endpoint
        assert _refused(_client(made, zmq.SUB, stream, keys))
        assert _refused(_client(made, zmq.REQ, trigger_endpoint, keys))

        shutil.copy(client_public, clients)
        assert pub.reload_client_keys() == 1  # once, for both sockets
        sub = _client(made, zmq.SUB, stream, keys)
        req = _client(made, zmq.REQ, trigger_endpoint, keys)
        assert _streamed(pub, sub, 30) and _answered(trigger, req, 30)

        (clients / client_public.name).unlink()
        assert pub.reload_client_keys() == 0
        # Both sockets were bound afresh: the connections made while the key was allowed are cut off,
        # and the clients' reconnections refused.
        assert _refused(sub) and _refused(req)
    finally:
        trigger.close()
        pub.close()
        for sock in made:
            monitor = sock.get_monitor_socket()
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        context.term()
    assert _auth_threads() == before
