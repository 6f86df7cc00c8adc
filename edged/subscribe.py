"""The subscriber side: a small client for edged's stream, and ``edged subscribe``.

`Subscriber` connects a SUB socket, validates every message against the schema, and counts
what a PUB socket cannot tell the publisher: messages lost on the way (gaps in ``seq``) and
payloads it had to reject. Applications can use it directly instead of hand-parsing JSON.

``edged subscribe`` follows the cameras it hears from, and stops (exit 0) once every one of them
says in its status that its source has ended (a video file or image folder played to its end):
the daemon stops then, so nothing more would come.

Given `ClientKeys` it speaks CurveZMQ to a publisher that requires it. A refused handshake
(key not allowed, wrong server key, CURVE on one side only) looks like silence on a SUB socket,
so the socket's monitor is watched and the reason kept in ``stats.handshake_error``.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import zmq
from zmq.utils.monitor import recv_monitor_message

from edged.errors import MessageError
from edged.keys import ClientKeys
from edged.listen import socket_with_room
from edged.messages import (
    AnomalyRegion,
    Detection,
    DetectionsMessage,
    StatusMessage,
    TriggerError,
    VerdictMessage,
    for_terminal,
    parse_message,
)
from edged.settings.endpoints import by_name, connect_ipv6, look_up

Message = DetectionsMessage | StatusMessage | VerdictMessage
TOP_SHOWN = 3  # a classifier's best classes on a line; --json has all of model.top_k

HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the publisher refused this subscriber's key "
    "(is its .key file in the publisher's publish.curve_clients_dir?)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "security handshake failed: CURVE is configured on one side only "
    "(--server-key/--client-key here, publish.curve_* there)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "security handshake failed: is --server-key the publisher's "
    "public key, and does it use CURVE?",
}


# Once every camera heard from has ended, how long the stream must bring no other camera before
# ``edged subscribe`` stops: more than the status interval (1 s by default), so a subscriber that
# joined between two cameras' status messages hears from the one still running first.
ENDED_QUIET_S = 2.0
SILENCE_S = 5.0  # nothing at all by then is said once: a wrong address or port waits in silence otherwise


@dataclass
class Cameras:
    """The cameras a subscriber has heard from and what their last status said of their source."""

    states: dict[str, str] = field(default_factory=dict)
    all_ended_since: float | None = None

    def heard(self, msg: Message, now: float) -> None:
        if isinstance(msg, StatusMessage):
            self.states[msg.camera_id] = msg.source_state
        else:
            self.states.setdefault(msg.camera_id, "unknown")
        all_ended = all(state == "ended" for state in self.states.values())
        if not all_ended:
            self.all_ended_since = None
        elif self.all_ended_since is None:
            self.all_ended_since = now

    def over(self, now: float) -> bool:
        """Every camera heard from has ended, and none other has spoken up since."""
        return self.all_ended_since is not None and now - self.all_ended_since >= ENDED_QUIET_S


@dataclass
class StreamStats:
    received: Counter[str] = field(default_factory=Counter)
    rejected: int = 0
    lost: int = 0
    handshake_failures: int = 0
    handshake_error: str | None = None
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

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        curve: ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.stats = StreamStats()
        self._context = context or zmq.Context.instance()
        self._socket = socket_with_room(self._context, zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.unresolved: str | None = None  # why the endpoint's host name resolved to nothing when connecting
        addresses: list[str] = []
        if (host := by_name(endpoint)) is not None:
            found = look_up(host, None)  # a signal (Ctrl-C) ends the wait
            addresses, self.unresolved = ([], found) if isinstance(found, str) else (found, None)
        self._socket.setsockopt(zmq.IPV6, int(connect_ipv6(endpoint, addresses)))
        if curve is not None:
            curve.apply(self._socket)
        self._monitor = self._socket.get_monitor_socket(sum(HANDSHAKE_FAILURES))  # distinct bits
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._socket.connect(endpoint)

    def receive(self, timeout_s: float) -> Message | None:
        """The next valid message, or None when nothing valid arrived within the timeout."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(self._poller.poll(int(left * 1000) + 1))
            if self._monitor in ready:
                self._handshake_failed(recv_monitor_message(self._monitor))
            if self._socket not in ready:
                continue
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

    def _handshake_failed(self, event: Mapping[str, Any]) -> None:
        self.stats.handshake_failures += 1
        self.stats.handshake_error = HANDSHAKE_FAILURES.get(event["event"], f"socket event {event['event']}")

    @staticmethod
    def parse(frames: list[bytes]) -> Message:
        if len(frames) != 2:
            raise MessageError(f"expected 2 frames (topic, payload), got {len(frames)}")
        msg = parse_message(frames[1])
        if isinstance(msg, TriggerError):
            raise MessageError("a trigger reply is not a stream message")
        return msg

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)


def format_verdict(msg: VerdictMessage) -> str:
    """One line: the verdict, the part, and what made it NG, as `for_terminal` lets it reach a terminal."""
    part = f" part {msg.part_id}" if msg.part_id is not None else ""
    why = "; ".join(f"{r.label} {r.score:.2f}" + (f" in {r.zone}" if r.zone else "") for r in msg.reasons)
    return for_terminal(
        f"[verdict {msg.camera_id} frame {msg.frame_id}{_from(msg.source_file)}{part}] {msg.verdict.upper()}"
        f"{': ' + why if why else ''}  ({msg.verdict_latency_ms:.1f} ms capture to verdict)"
    )


def _from(source_file: str | None) -> str:
    """The image a frame was read from, for a line that says which of a folder's files gave it."""
    return f" {source_file}" if source_file is not None else ""


def format_message(msg: Message) -> str:
    """One line of ``edged subscribe``, as `for_terminal` lets it reach a terminal."""
    if isinstance(msg, VerdictMessage):
        return format_verdict(msg)
    if isinstance(msg, StatusMessage):
        drops = ", ".join(f"{k}={v}" for k, v in sorted(msg.drops.items()) if v) or "none"
        thermal = msg.thermal.state if msg.thermal else "off"
        return for_terminal(
            f"[status {msg.camera_id}] {msg.fps:.1f} fps, camera {msg.source_state}, "
            f"thermal {thermal}, {msg.frames_processed} frames, drops: {drops}"
        )
    verdict = f" {msg.verdict.upper()}" if msg.verdict else ""
    return for_terminal(
        f"[{msg.camera_id} frame {msg.frame_id}{_from(msg.source_file)}]{verdict} {_result(msg)}  "
        f"({msg.timings.inference_ms:.1f} ms inference, {msg.timings.age_ms:.1f} ms old)"
    )


def _result(msg: DetectionsMessage) -> str:
    """What the model found, as its task gives it: a classifier's best classes, an anomaly model's
    score and regions, a detector's boxes (with a segmentation model's sizes)."""
    if msg.top is not None:
        return "top: " + ", ".join(f"{c.label} {c.score:.2f}" for c in msg.top[:TOP_SHOWN])
    if msg.anomaly_score is not None:
        regions = "; ".join(_box(r.box) + _size(r) + (f" {r.note}" if r.note else "") for r in msg.regions or [])
        threshold = f" (threshold {msg.threshold:.2f})" if msg.threshold is not None else ""
        return f"anomaly score {msg.anomaly_score:.2f}{threshold}, {len(msg.regions or [])} region(s)" + (
            f": {regions}" if regions else ""
        )
    dets = "; ".join(
        f"{d.label} {d.score:.2f} {_box(d.box)}{_size(d)}" + (f" {d.note}" if d.note else "") for d in msg.detections
    )
    return f"{len(msg.detections)} detection(s)" + (f": {dets}" if dets else "")


def _box(box: tuple[float, float, float, float]) -> str:
    return f"({box[0]:.0f},{box[1]:.0f})-({box[2]:.0f},{box[3]:.0f})"


def _mm(value: float) -> str:
    """A size in mm to a tenth, or to two significant digits below 1 mm: 0.02, not 0.0, under a fine scale."""
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def _size(d: Detection | AnomalyRegion) -> str:
    """Length by width, in mm with a scale, else in pixels; nothing for a detector's boxes."""
    if d.length_mm is not None and d.width_mm is not None:
        return f" {_mm(d.length_mm)}x{_mm(d.width_mm)} mm"
    if d.length_px is not None and d.width_px is not None:
        return f" {d.length_px:.0f}x{d.width_px:.0f} px"
    return ""


def run_subscribe(
    endpoint: str,
    topic: str,
    *,
    stats: bool,
    raw_json: bool,
    count: int | None,
    timeout_s: float | None,
    server_key: Path | None = None,
    client_key: Path | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Print messages (or a rolling summary) until interrupted, ``count`` messages or a timeout."""
    curve = ClientKeys.from_options(server_key, client_key)
    try:
        sub = Subscriber(endpoint, topic, curve=curve)
    except KeyboardInterrupt:  # while its host name was looked up
        return 0
    if sub.unresolved is not None:  # libzmq keeps trying the name: it may resolve later
        print(f"edged subscribe: {sub.unresolved}: still trying", file=sys.stderr)
    try:
        return _print_stream(sub, stats=stats, raw_json=raw_json, count=count, timeout_s=timeout_s, out=out)
    except KeyboardInterrupt:
        return 0
    finally:
        if sub.stats.rejected:
            print(
                f"rejected {sub.stats.rejected} message(s); last: {for_terminal(str(sub.stats.last_error))}", file=sys.stderr
            )
        sub.close()


def _print_stream(
    sub: Subscriber, *, stats: bool, raw_json: bool, count: int | None, timeout_s: float | None, out: TextIO
) -> int:
    """Print messages (or, with ``stats``, a summary each second and a last one at the end) until done:
    ``count`` messages, the timeout, or every camera heard from has ended (`Cameras`)."""
    started = last_summary = time.monotonic()
    shown = 0
    told: str | None = None
    silence_said = False
    code = 0
    cameras = Cameras()
    while count is None or shown < count:
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            print(f"no more messages within {timeout_s:g} s", file=sys.stderr)
            code = 1 if shown == 0 else 0
            break
        if cameras.over(time.monotonic()):
            print(
                f"edged subscribe: every camera has ended ({for_terminal(', '.join(cameras.states))}): the stream is over",
                file=sys.stderr,
            )
            break
        msg = sub.receive(0.5)
        if sub.stats.handshake_error != told:  # say it once; the socket keeps retrying
            told = sub.stats.handshake_error
            print(f"edged subscribe: {told}", file=sys.stderr)
        if stats and time.monotonic() - last_summary >= 1.0:
            last_summary = time.monotonic()
            _print_summary(sub.stats, out)
        if msg is None:
            quiet = not sub.stats.received and told is None and sub.unresolved is None  # else said already
            if not silence_said and quiet and time.monotonic() - started >= SILENCE_S:
                silence_said = True
                print(
                    f"edged subscribe: nothing received from {sub.endpoint} in {SILENCE_S:g} s (is edged running and "
                    "publishing there? publish.endpoints): still listening",
                    file=sys.stderr,
                )
            continue
        cameras.heard(msg, time.monotonic())
        shown += 1
        if not stats:
            print(msg.model_dump_json() if raw_json else format_message(msg), file=out, flush=True)
    if stats:
        _print_summary(sub.stats, out)
    return code


def _print_summary(s: StreamStats, out: TextIO) -> None:
    received = ", ".join(f"{kind} {n}" for kind, n in sorted(s.received.items()))
    print(f"received {received or 'nothing'}; lost {s.lost}, rejected {s.rejected}", file=out, flush=True)
