"""The ZeroMQ sockets edged binds (`edged.listen.Listener`), on an IPv6 address, on ``*`` and on a host
name: real libzmq sockets on loopback (127.0.0.1 and ::1), reached by real TCP and ZeroMQ peers."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from daemon import RunningDaemon, free_port, write_config, write_video
from onnx_models import colour_probe
from waiting import wait_for

from edged.errors import PublishError
from edged.listen import Listener, try_bind
from edged.settings import endpoints

pytestmark = pytest.mark.integration


@pytest.fixture
def listener() -> Iterator[Listener]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = Listener(context, zmq.XPUB, lambda s: s.setsockopt(zmq.LINGER, 0), "publish.endpoints")
    try:
        yield sock
    finally:
        sock.close(linger=0)
        context.term()


def reachable(family: socket.AddressFamily, address: str, port: int) -> bool:
    with socket.socket(family) as probe:
        probe.settimeout(2)
        return probe.connect_ex((address, port)) == 0


def test_an_ipv6_address_is_bound_as_written(listener: Listener) -> None:
    port = free_port()
    assert listener.bind(f"tcp://[::1]:{port}") == f"tcp://[::1]:{port}"
    assert reachable(socket.AF_INET6, "::1", port)
    unbracketed = free_port()  # libzmq takes the last colon for the port's
    assert listener.bind(f"tcp://::1:{unbracketed}") == f"tcp://[::1]:{unbracketed}"


def test_star_is_every_address_ipv6_and_ipv4_alike(listener: Listener) -> None:
    port = free_port()
    listener.bind(f"tcp://*:{port}")
    assert reachable(socket.AF_INET, "127.0.0.1", port) and reachable(socket.AF_INET6, "::1", port)


def test_a_name_binds_its_ipv4_address_as_before_beside_an_ipv6_one() -> None:
    v6, name = free_port(), free_port()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    listener = Listener(context, zmq.XPUB, lambda s: s.setsockopt(zmq.LINGER, 0), "publish.endpoints")
    try:
        listener.bind(f"tcp://[::1]:{v6}")
        assert listener.bind(f"tcp://localhost:{name}") == f"tcp://127.0.0.1:{name}"  # not ::ffff:127.0.0.1
        listener = listener.reopen()  # a revoked key binds both afresh, each as it was
        assert listener.endpoints == [f"tcp://[::1]:{v6}", f"tcp://127.0.0.1:{name}"]
        assert reachable(socket.AF_INET6, "::1", v6) and reachable(socket.AF_INET, "127.0.0.1", name)
    finally:
        listener.close(linger=0)
        context.term()


def test_a_zeromq_subscriber_reaches_an_ipv6_publisher() -> None:
    port = free_port()
    release = try_bind(f"tcp://[::1]:{port}", "publish.endpoints", zmq.XPUB)  # as `edged check` binds it
    release()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = Listener(context, zmq.PUB, lambda s: s.setsockopt(zmq.LINGER, 0), "publish.endpoints")
    sub = context.socket(zmq.SUB)
    try:
        pub.bind(f"tcp://[::1]:{port}")
        assert endpoints.connect_ipv6(f"tcp://[::1]:{port}") and not endpoints.connect_ipv6(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://[::1]:{port}")
        for _ in range(100):
            pub.socket.send(b"hello")
            if sub.poll(100):
                break
        assert sub.recv() == b"hello"
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
        context.term()


def test_an_address_no_interface_has_says_so_naming_the_key(listener: Listener) -> None:
    with pytest.raises(PublishError) as e:
        listener.bind(f"tcp://[2001:db8::7]:{free_port()}")
    assert "publish.endpoints" in str(e.value) and "no interface of this board has that address" in str(e.value)


def test_exposure_of_a_name_that_resolves_to_nothing_is_left_to_the_bind() -> None:
    # `.invalid` never resolves (RFC 6761); the lookup is the machine's resolver, which says so at once
    # or after its timeout: either way no configuration is refused for a name DNS cannot answer today.
    endpoint = "tcp://edge7.invalid:5556"
    if not isinstance(endpoints.look_up("edge7.invalid", 10), str):
        pytest.skip("this machine's resolver resolves edge7.invalid")
    assert not endpoints.on_the_network(endpoint)
    assert endpoints.exposure(endpoint) is None
    assert "edge7.invalid resolves to no address now" in endpoints.unresolved(endpoint)
    assert (
        endpoints.on_the_network("tcp://*:5556")
        and not endpoints.on_the_network("tcp://[::1]:5556")
        and not endpoints.on_the_network("tcp://lo:5556")
    )
    assert endpoints.exposure("tcp://[::1]:5556") is False and endpoints.exposure("ipc:///run/edged/x.sock") is False


def test_the_servers_on_every_ipv6_address_take_ipv4_clients_too(tmp_path: Path) -> None:
    # "[::]" is every address, as ZeroMQ's "*": an IPv4 PLC or browser reaches the Modbus, OPC UA and
    # HTTP servers there as an IPv6 one does (asyncio alone would bind "::" for IPv6 only).
    colour_probe(tmp_path / "probe.onnx")
    write_video(tmp_path / "clip.avi", [(0, 0, 255), (255, 0, 0)] * 20)
    token, users = tmp_path / "token", tmp_path / "users"
    for path, text in ((token, "t" * 32), (users, "plc:a-long-enough-password")):
        path.write_text(text)
        path.chmod(0o600)
    http, modbus, opcua = free_port(), free_port(), free_port()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "file", "path": "clip.avi", "loop": True},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [endpoint]},
            "thermal": {"enabled": False},
            "journal": {"enabled": False},
            "http": {"listen": f"[::]:{http}", "token_file": str(token)},
            "modbus": {"listen": f"[::]:{modbus}", "allow_remote": True},
            "opcua": {"listen": f"opc.tcp://[::]:{opcua}", "users_file": str(users)},
        },
    )
    d = RunningDaemon(config, endpoint)
    try:
        assert wait_for(lambda: "OPC UA: serving camera" in d.log() and "Modbus TCP on [::]" in d.log(), 60), d.log()
        for port in (http, modbus, opcua):
            assert reachable(socket.AF_INET6, "::1", port), (port, d.log())
            assert reachable(socket.AF_INET, "127.0.0.1", port), (port, d.log())
        assert f"Modbus TCP on [::]:{modbus}" in d.log() and f"opc.tcp://[::]:{opcua}" in d.log()
        assert d.stop() == 0, d.log()
    finally:
        d.close()
