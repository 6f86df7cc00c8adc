"""The hand-over of requests from the MQTT thread to the loop (`edged.trigger.Inbox`), from a real second thread."""

from __future__ import annotations

import threading

import zmq

from edged.trigger import Inbox, Request


def _request(part: str, arrived_ns: int) -> Request:
    return Request("mqtt", (), "cam0", part, arrived_ns)


def test_the_inbox_is_bounded_keeps_order_and_wakes_a_waiting_loop() -> None:
    inbox = Inbox(limit=2)
    try:
        assert zmq.select([inbox.wake], [], [], 0)[0] == []  # nothing yet: a wait would sleep
        accepted: list[bool] = []
        sender = threading.Thread(target=lambda: accepted.extend(inbox.put(_request(p, i)) for i, p in enumerate("ABC")))
        sender.start()
        assert zmq.select([inbox.wake], [], [], 30)[0] == [inbox.wake.fileno()]  # the loop's wait ends
        sender.join(30)
        assert accepted == [True, True, False]  # the third is beyond the bound: the caller answers busy
        assert [r.part_id for r in inbox.take()] == ["A", "B"]
        assert zmq.select([inbox.wake], [], [], 0)[0] == [] and inbox.take() == []  # taken: no wake-up left
        assert inbox.put(_request("D", 3)) and [r.part_id for r in inbox.take()] == ["D"]
    finally:
        inbox.close()
    assert not inbox.put(_request("E", 4))  # closed: refused, never a write to a closed socket
