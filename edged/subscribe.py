"""The subscriber side: a small client for edged's stream, and ``edged subscribe``.

`Subscriber` connects a SUB socket, validates every message against the schema, and counts
what a PUB socket cannot tell the publisher: messages lost on the way (gaps in ``seq``) and
payloads it had to reject. Applications can use it directly instead of hand-parsing JSON.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TextIO

import zmq

from edged.messages import DetectionsMessage, MessageError, StatusMessage, parse_message

Message = DetectionsMessage | StatusMessage


@dataclass
class StreamStats:
    received: Counter[str] = field(default_factory=Counter)
    rejected: int = 0
    lost: int = 0
    last_error: str | None = None
    _last_seq: dict[tuple[str, str], int] = field(default_factory=dict)

    def track(self, msg: Message) -> None:
        """Count gaps per (kind, camera): a restarted publisher (seq back to 0) is not a gap."""
        key = (msg.kind, msg.camera_id)
        previous = self._last_seq.get(key)
        if previous is not None and msg.seq > previous + 1:
            self.lost += msg.seq - previous - 1
        self._last_seq[key] = msg.seq
        self.received[msg.kind] += 1


class Subscriber:
    """A SUB socket on one endpoint, yielding validated messages."""

    def __init__(self, endpoint: str, topic: str = "", *, context: zmq.Context | None = None) -> None:
        self.stats = StreamStats()
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.connect(endpoint)

    def receive(self, timeout_s: float) -> Message | None:
        """The next valid message, or None when nothing valid arrived within the timeout."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._socket.poll(int(left * 1000) + 1):
                return None
            frames = self._socket.recv_multipart()
            try:
                msg = self.parse(frames)
            except MessageError as e:
                self.stats.rejected += 1
                self.stats.last_error = str(e)
                continue
            self.stats.track(msg)
            return msg
        return None

    @staticmethod
    def parse(frames: list[bytes]) -> Message:
        if len(frames) != 2:
            raise MessageError(f"expected 2 frames (topic, payload), got {len(frames)}")
        return parse_message(frames[1])

    def close(self) -> None:
        self._socket.close(linger=0)


def format_message(msg: Message) -> str:
    if isinstance(msg, StatusMessage):
        drops = ", ".join(f"{k}={v}" for k, v in sorted(msg.drops.items()) if v) or "none"
        thermal = msg.thermal.get("state", "?") if msg.thermal else "off"
        return (f"[status {msg.camera_id}] {msg.fps:.1f} fps, camera {msg.source_state}, "
                f"thermal {thermal}, {msg.frames_processed} frames, drops: {drops}")
    dets = "; ".join(
        f"{d.label} {d.score:.2f} ({d.box[0]:.0f},{d.box[1]:.0f})-({d.box[2]:.0f},{d.box[3]:.0f})"
        for d in msg.detections
    )
    return (f"[{msg.camera_id} frame {msg.frame_id}] {len(msg.detections)} detection(s)"
            f"{': ' + dets if dets else ''}  ({msg.timings.inference_ms:.1f} ms inference, "
            f"{msg.timings.age_ms:.1f} ms old)")


def run_subscribe(endpoint: str, topic: str, *, stats: bool, raw_json: bool, count: int | None,
                  timeout_s: float | None, out: TextIO = sys.stdout) -> int:
    """Print messages (or a rolling summary) until interrupted, ``count`` messages or a timeout."""
    sub = Subscriber(endpoint, topic)
    started = last_summary = time.monotonic()
    shown = 0
    try:
        while count is None or shown < count:
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                print(f"no more messages within {timeout_s:g} s", file=sys.stderr)
                return 1 if shown == 0 else 0
            msg = sub.receive(0.5)
            if stats and time.monotonic() - last_summary >= 1.0:
                last_summary = time.monotonic()
                s = sub.stats
                print(f"received {dict(s.received)}, lost {s.lost}, rejected {s.rejected}", file=out, flush=True)
            if msg is None:
                continue
            shown += 1
            if not stats:
                print(msg.model_dump_json() if raw_json else format_message(msg), file=out, flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        if sub.stats.rejected:
            print(f"rejected {sub.stats.rejected} message(s); last: {sub.stats.last_error}", file=sys.stderr)
        sub.close()
    return 0
