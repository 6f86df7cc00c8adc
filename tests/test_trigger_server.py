"""`edged.trigger.TriggerServer` for two cameras, driven as the daemon loop drives it, with real REQ clients.

Each request is sent, then the test waits on the server's ``fds`` until it is readable and calls
``collect``, so every request is read before the next is sent and the order is the test's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from edged.config import PublishConfig, TriggerConfig
from edged.messages import AnyMessage, TriggerError, parse_message
from edged.trigger import Request, TriggerServer

WAIT_S = 30.0


class Clients:
    """REQ sockets of this process, one per request, on the server's endpoint."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.context = zmq.Context()
        self.sockets: list[zmq.Socket[bytes]] = []

    def send(self, payload: bytes) -> zmq.Socket[bytes]:
        sock = self.context.socket(zmq.REQ)
        self.sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        sock.send(payload)
        return sock

    @staticmethod
    def reply(sock: zmq.Socket[bytes]) -> AnyMessage:
        assert sock.poll(int(WAIT_S * 1000)), "no reply"
        return parse_message(sock.recv())

    @staticmethod
    def no_reply_yet(sock: zmq.Socket[bytes]) -> bool:
        return sock.poll(0) == 0

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[Clients]:
    c = Clients(f"ipc://{tmp_path / 'trigger.sock'}")
    yield c
    c.close()


def serve(clients: Clients, cameras: list[str], queue: int = 4) -> TriggerServer:
    cfg = TriggerConfig(mode="request", endpoint=clients.endpoint, queue=queue)
    return TriggerServer(cfg, PublishConfig(), cameras)


def arrive(server: TriggerServer, clients: Clients, payload: bytes) -> zmq.Socket[bytes]:
    """Send ``payload`` and have the server read it (the loop's select, then collect)."""
    sock = clients.send(payload)
    assert zmq.select(server.fds, [], [], WAIT_S)[0], "the request never arrived"
    server.collect()
    return sock


def error(reply: AnyMessage) -> tuple[str, str, str | None]:
    assert isinstance(reply, TriggerError), reply
    return reply.error, reply.camera_id, reply.part_id


def taken(server: TriggerServer, camera_id: str) -> Request:
    request = server.next(camera_id)
    assert request is not None, f"no request for {camera_id}"
    return request


def test_requests_go_to_their_cameras_and_an_answer_frees_only_its_own(clients: Clients) -> None:
    server = serve(clients, ["top", "side"])
    try:
        a = arrive(server, clients, b'{"part_id": "A", "camera_id": "top"}')
        b = arrive(server, clients, b'{"camera_id": "side", "part_id": "B"}')
        c = arrive(server, clients, b'{"part_id": "C", "camera_id": "top"}')
        first, other = taken(server, "top"), taken(server, "side")  # one in hand per camera, both at once
        assert (first.camera_id, first.part_id, other.camera_id, other.part_id) == ("top", "A", "side", "B")
        assert first.origin == "zmq" and first.arrived_ns < other.arrived_ns
        with pytest.raises(AssertionError, match="camera top already has a request in hand"):
            server.next("top")
        server.answer(first, server.error(first, "timeout", "no frame"))
        assert error(clients.reply(a)) == ("timeout", "top", "A")
        assert clients.no_reply_yet(b)  # side's is still in hand
        with pytest.raises(AssertionError, match="camera side already has a request in hand"):
            server.next("side")
        assert taken(server, "top").part_id == "C"  # top is free again
        server.answer(other, server.error(other, "camera_lost", "gone"))
        assert error(clients.reply(b)) == ("camera_lost", "side", "B") and server.next("side") is None
        assert clients.no_reply_yet(c)
    finally:
        server.close()


def test_a_request_naming_no_camera_or_another_is_a_bad_request_naming_the_cameras(clients: Clients) -> None:
    server = serve(clients, ["top", "side"])
    try:
        for payload, camera, part in (
            (b'{"part_id": "X"}', "", "X"),
            (b"", "", None),
            (b'{"camera_id": "front"}', "front", None),
        ):
            reply = clients.reply(arrive(server, clients, payload))
            assert error(reply) == ("bad_request", camera, part), reply
            assert isinstance(reply, TriggerError) and "the cameras that do: top, side" in reply.detail, reply
        for payload, detail in (
            (b"not json", "a request is JSON"),
            (b'{"camera_id": "a b"}', "camera_id must be a camera's name"),
            (b'{"camera_id": 7}', "camera_id must be a camera's name"),
            (b'{"part_id": ""}', "part_id must be a string of 1 to 128 characters"),
            (b'{"part_id": "A", "camera": "top"}', 'the keys "part_id" and "camera_id" only, not \'camera\''),
            (b'["top"]', "a JSON object, not a list"),
        ):
            reply = clients.reply(arrive(server, clients, payload))
            assert isinstance(reply, TriggerError) and reply.error == "bad_request" and detail in reply.detail, reply
        assert server.next("top") is None and server.next("side") is None
    finally:
        server.close()


def test_a_part_id_with_control_or_format_characters_is_a_bad_request_naming_the_character(clients: Clients) -> None:
    # Part ids reach every subscriber and terminal: a newline forges a log line, U+202E reverses what follows.
    server = serve(clients, ["cam0"])
    try:
        for escaped, named in (
            (r"A-1\u0000", "U+0000"),
            (r"A-1\nOK", "U+000A"),
            (r"A-1\u001b[2J", "U+001B"),
            (r"A-1\u0085", "U+0085"),
            (r"A-\u202eGN", "U+202E"),
            (r"A-\u200b1", "U+200B"),
            (r"A-\ufeff1", "U+FEFF"),
            (r"A-1\u2028", "U+2028"),
            (r"A-1\ud800", "U+D800"),
        ):
            payload = b'{"part_id": "' + escaped.encode() + b'"}'
            reply = clients.reply(arrive(server, clients, payload))
            assert error(reply) == ("bad_request", "cam0", None), reply
            assert isinstance(reply, TriggerError) and named in reply.detail and "part_id" in reply.detail, reply
        assert server.next("cam0") is None
        arrive(server, clients, '{"part_id": "Ä-1 部品 #7"}'.encode())
        assert taken(server, "cam0").part_id == "Ä-1 部品 #7"
    finally:
        server.close()


def test_with_one_camera_in_request_mode_a_request_may_leave_it_out(clients: Clients) -> None:
    server = serve(clients, ["cam0"])
    try:
        arrive(server, clients, b'{"part_id": "A"}')
        arrive(server, clients, b'{"part_id": "B", "camera_id": "cam0"}')
        first = taken(server, "cam0")
        assert (first.camera_id, first.part_id) == ("cam0", "A")
        server.answer(first, server.error(first, "timeout", "no frame"))
        second = taken(server, "cam0")
        assert (second.camera_id, second.part_id) == ("cam0", "B")
        malformed = clients.reply(arrive(server, clients, b"{"))
        assert error(malformed) == ("bad_request", "cam0", None)
    finally:
        server.close()


def test_beyond_the_queue_behind_a_cameras_request_in_hand_is_busy_and_other_cameras_are_not(clients: Clients) -> None:
    server = serve(clients, ["top", "side"], queue=1)
    try:
        arrive(server, clients, b'{"part_id": "A", "camera_id": "top"}')
        arrive(server, clients, b'{"part_id": "B", "camera_id": "top"}')
        busy = clients.reply(arrive(server, clients, b'{"part_id": "C", "camera_id": "top"}'))
        assert error(busy) == ("busy", "top", "C")
        assert isinstance(busy, TriggerError) and "2 request(s) for camera top already in hand" in busy.detail
        d = arrive(server, clients, b'{"part_id": "D", "camera_id": "side"}')
        a = taken(server, "top")
        assert error(clients.reply(arrive(server, clients, b'{"part_id": "E", "camera_id": "top"}'))) == ("busy", "top", "E")
        server.answer(a, server.error(a, "timeout", "no frame"))
        f = arrive(server, clients, b'{"part_id": "F", "camera_id": "top"}')  # A answered: room for one again
        assert [taken(server, "side").part_id, taken(server, "top").part_id] == ["D", "B"]
        assert clients.no_reply_yet(d) and clients.no_reply_yet(f)
    finally:
        server.close()


def test_following_the_cameras_answers_the_requests_waiting_for_a_camera_removed(clients: Clients) -> None:
    server = serve(clients, ["top", "side"])
    try:
        g = arrive(server, clients, b'{"part_id": "G", "camera_id": "side"}')
        h = arrive(server, clients, b'{"part_id": "H", "camera_id": "side"}')
        i = arrive(server, clients, b'{"part_id": "I", "camera_id": "top"}')
        server.follow_cameras(["top", "back"])
        for sock, part in ((g, "G"), (h, "H")):
            reply = clients.reply(sock)  # at once: no collect, no answer from the loop
            assert error(reply) == ("bad_request", "side", part)
            assert isinstance(reply, TriggerError) and "camera side no longer takes requests" in reply.detail
        assert clients.no_reply_yet(i) and taken(server, "top").part_id == "I"
        late = clients.reply(arrive(server, clients, b'{"part_id": "J", "camera_id": "side"}'))
        assert isinstance(late, TriggerError) and "the cameras that do: top, back" in late.detail, late
        arrive(server, clients, b'{"part_id": "K", "camera_id": "back"}')
        assert taken(server, "back").part_id == "K"
    finally:
        server.close()


def test_close_answers_every_request_in_hand_waiting_or_unread_that_edged_is_stopping(clients: Clients) -> None:
    server = serve(clients, ["top", "side"])
    socks = [
        arrive(server, clients, b'{"part_id": "A", "camera_id": "top"}'),
        arrive(server, clients, b'{"part_id": "B", "camera_id": "top"}'),
        arrive(server, clients, b'{"part_id": "C", "camera_id": "side"}'),
    ]
    taken(server, "top")
    socks.append(clients.send(b'{"part_id": "D", "camera_id": "side"}'))
    assert zmq.select(server.fds, [], [], WAIT_S)[0]  # arrived, not yet read
    server.close()
    replies = [clients.reply(sock) for sock in socks]
    assert [error(reply) for reply in replies] == [
        ("stopping", "top", "A"),
        ("stopping", "top", "B"),
        ("stopping", "side", "C"),
        ("stopping", "side", "D"),
    ]


def test_a_request_offered_from_another_thread_is_queued_in_arrival_order_and_answered_through_its_callable(
    clients: Clients,
) -> None:
    server = serve(clients, ["top", "side"], queue=1)
    replies: list[tuple[str, AnyMessage]] = []

    def answer(part_id: str) -> Callable[[AnyMessage], None]:
        return lambda reply: replies.append((part_id, reply))

    try:
        sock = arrive(server, clients, b'{"part_id": "A", "camera_id": "top"}')
        assert taken(server, "top").part_id == "A"
        offering = threading.Thread(
            target=lambda: [server.offer("plc", camera, part, answer(part)) for camera, part in OFFERED], daemon=True
        )
        offering.start()
        offering.join(WAIT_S)
        assert zmq.select(server.fds, [], [], WAIT_S)[0], "the offered requests never woke the loop"
        server.collect()  # B waits behind A; C is beyond top's bound; D names a camera that takes none here
        assert [(part, error(reply)[0]) for part, reply in replies] == [("C", "busy"), ("D", "bad_request")]
        replies.clear()
        first = server.in_hand("top")
        assert first is not None
        server.answer(first, server.error(first, "timeout", "no frame"))
        assert error(clients.reply(sock)) == ("timeout", "top", "A")
        offered = taken(server, "top")
        assert (offered.origin, offered.part_id, replies) == ("plc", "B", [])
        server.answer(offered, server.error(offered, "timeout", "no frame"))
        assert [(part, error(reply)) for part, reply in replies] == [("B", ("timeout", "top", "B"))]
    finally:
        server.close()
    replies.clear()
    server.offer("plc", "side", "E", answer("E"))  # once closed: refused at once, on the offering thread
    assert [(part, error(reply)[0]) for part, reply in replies] == [("E", "stopping")]


OFFERED = (("top", "B"), ("top", "C"), ("nowhere", "D"))


def test_a_request_in_several_parts_is_a_bad_request_in_one_part_and_a_dealers_request_is_answered(
    clients: Clients,
) -> None:
    # The last part was taken as the request and the others as routing frames: the client got its
    # first part back before a verdict for the second's part id.
    server = serve(clients, ["top"])
    try:
        sock = clients.context.socket(zmq.REQ)
        clients.sockets.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(clients.endpoint)
        sock.send_multipart([b'{"part_id": "A"}', b'{"part_id": "B"}'])
        assert zmq.select(server.fds, [], [], WAIT_S)[0]
        server.collect()
        assert sock.poll(int(WAIT_S * 1000))
        [reply] = sock.recv_multipart()
        answer = parse_message(reply)
        assert isinstance(answer, TriggerError) and answer.error == "bad_request", answer
        assert answer.detail == "a request is one message part, not 2" and server.next("top") is None
        dealer = clients.context.socket(zmq.DEALER)  # no empty frame: its identity is the whole envelope
        clients.sockets.append(dealer)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(clients.endpoint)
        dealer.send(b'{"part_id": "D"}')
        assert zmq.select(server.fds, [], [], WAIT_S)[0]
        server.collect()
        request = taken(server, "top")
        assert request.part_id == "D"
        server.answer(request, server.error(request, "timeout", "none"))
        assert dealer.poll(int(WAIT_S * 1000))
        [reply] = dealer.recv_multipart()
        assert error(parse_message(reply)) == ("timeout", "top", "D")
    finally:
        server.close()
