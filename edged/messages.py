"""The wire schema: every message edged publishes, as pydantic models.

These models are the single source of truth: the JSON Schema that subscribers validate against
(`edged/messages.schema.json`, printed by ``edged schema``) is generated from them, and a test
fails when the committed file is stale.

How the schema evolves, so that a subscriber written today keeps working:

- A new field is always an addition: optional in the schema, and ``schema_version`` stays.
  Readers ignore fields they do not know: the published schema allows additional properties and
  `parse_message` drops them, so an older subscriber, validating or not, accepts a newer edged.
- ``schema_version`` changes whenever a field is removed, renamed, changes type or meaning, or a
  closed set of values (the schema's enums: ``kind``, ``verdict``, ``task``, the states) gains a
  member, since a validating subscriber would refuse the new value.
- ``schema_version`` and ``kind`` are required: a reader checks them before anything else.

Nanosecond timestamps exceed 2**53, so JavaScript's ``JSON.parse`` (every number a double) rounds
them to a multiple of 256 ns; each comes with a millisecond copy (``capture_time_ms``, ``time_ms``)
that a double holds to a quarter of a microsecond.

Wire format: a ZeroMQ multipart message of two frames, the topic and the JSON payload.
Topics are ``<prefix>/detections/<camera_id>``, ``<prefix>/status/<camera_id>`` and, with
``[inspect]``, ``<prefix>/verdict/<camera_id>``. A trigger request (`TriggerRequest`, in the
schema's ``$defs`` beside the messages) is answered with a verdict message or a `TriggerError`.
The MQTT output (`edged.mqtt`) sends the same payloads to a broker, under topics of its own.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, field_validator

from edged.errors import MessageError

SCHEMA_VERSION: Literal[2] = 2  # 2 since 0.4.0's 1: a verdict may be uncertain, status drops split stale


# The closed sets the state fields take; edged.thermal and edged.capture use these very types.
ThermalState = Literal["unknown", "ok", "warm", "throttled", "critical"]
CaptureState = Literal["starting", "ok", "lost", "ended"]

_MS_COPY = "{} in ms since the Unix epoch: a double (JavaScript's number) holds it to under a microsecond."


def ms_copy(ns_field: str) -> Any:
    """A computed field: the nanosecond timestamp ``ns_field`` in milliseconds, for JavaScript readers."""

    def in_ms(message: BaseModel) -> float:
        return float(getattr(message, ns_field)) / 1e6

    return computed_field(description=_MS_COPY.format(ns_field))(property(in_ms))


def absent_when_none(description: str, **constraints: Any) -> Any:
    """An optional field left out of the message while it is None (a size without a scale, a note)."""
    return Field(None, description=description, exclude_if=lambda v: v is None, **constraints)


def in_mm(size: float) -> float:
    """A size in mm or mm2 as a message carries it: to 6 significant digits, not to a fixed count of
    decimals, which would publish a defect of 0.0004 mm2 under a micrometre per pixel
    (``inspect.mm_per_px = 0.001``) as 0.0 beside the limit of 0.0002 it broke."""
    return float(f"{size:.6g}")


# A size in mm, from one in frame pixels and the camera's scale: absent without one.
AreaMm2 = Annotated[float | None, absent_when_none("area_px in mm2, with the camera's inspect.mm_per_px.", ge=0)]
LengthMm = Annotated[float | None, absent_when_none("length_px in mm, with inspect.mm_per_px.", ge=0)]
WidthMm = Annotated[float | None, absent_when_none("width_px in mm, with inspect.mm_per_px.", ge=0)]

ENVELOPE = ("schema_version", "kind")  # what every message has, and a reader checks first


def _reader_schema(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """What a reader may rely on: the fields `parse_message` requires, plus the envelope.

    The schema is generated for serialisation, so that it shows the millisecond copies too, but
    they and every defaulted field are left optional: a field added later has a default, so an
    older edged's messages still validate.
    """
    schema["required"] = [name for name, field in model.model_fields.items() if field.is_required() or name in ENVELOPE]
    schema["additionalProperties"] = True


class Message(BaseModel):
    """Unknown fields are ignored: they are what a newer edged adds (see the evolution rule above)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_reader_schema)


class Detection(Message):
    class_id: int = Field(ge=0, description="Index into the model's classes.")
    label: str = Field(description="Class name from the model metadata or the labels file.")
    score: float = Field(ge=0, le=1, description="Confidence after decoding.")
    box: tuple[float, float, float, float] = Field(
        description="x1, y1, x2, y2 in frame pixels (origin top-left), clipped to the frame."
    )
    zone: str | None = Field(None, description="The [inspect] zone the detection is in; null without zones or outside all.")
    threshold: float | None = Field(
        None, description="The score this class had to pass (inspect.class_conf or model.conf); null without [inspect]."
    )
    polygon: list[tuple[float, float]] | None = Field(
        None,
        description="A segmentation model's: the instance's outline, [x, y] in frame pixels (ultralytics' masks.xy), "
        "thinned to at most model.max_outline_points points (a mask in many pieces: its largest); absent for other "
        "tasks and past model.max_masks.",
        exclude_if=lambda polygon: polygon is None,
    )
    area_px: int | None = absent_when_none("A segmentation model's: the mask's pixels in the frame.", ge=0)
    length_px: float | None = absent_when_none(
        "A segmentation model's: the longer side of the mask's minimum-area rectangle, in frame pixels.", ge=0
    )
    width_px: float | None = absent_when_none(
        "A segmentation model's: the shorter side of the mask's minimum-area rectangle, in frame pixels.", ge=0
    )
    area_mm2: AreaMm2 = None
    length_mm: LengthMm = None
    width_mm: WidthMm = None
    note: str | None = absent_when_none(
        "Why a detection of an NG class did not make the part NG: 'within limits' (inside the size "
        "limits of [inspect] for its class); absent otherwise."
    )


class TopClass(Message):
    """One of a classification model's best classes for a frame."""

    class_id: int = Field(ge=0, description="Index into the model's classes.")
    label: str = Field(description="Class name from the model metadata or the labels file.")
    score: float = Field(ge=0, le=1, description="The model's probability of the class.")


class AnomalyRegion(Message):
    """One connected region of an anomaly model's mask."""

    box: tuple[float, float, float, float] = Field(description="x1, y1, x2, y2 in frame pixels, around the region.")
    area_px: float = Field(ge=0, description="Its area in frame pixels.")
    max_score: float = Field(ge=0, le=1, description="The highest anomaly map value in it (normalised: 0.5 the export's).")
    polygon: list[tuple[float, float]] = Field(description="Its outline, x, y points in frame pixels.")
    zone: str | None = Field(None, description="The [inspect] zone it is in; null without zones or outside all.")
    length_px: float = Field(ge=0, description="The longer side of its outline's minimum-area rectangle, in frame pixels.")
    width_px: float = Field(ge=0, description="The shorter side of its outline's minimum-area rectangle, in frame pixels.")
    area_mm2: AreaMm2 = None
    length_mm: LengthMm = None
    width_mm: WidthMm = None
    note: str | None = absent_when_none(
        "Why the region does not count against the part: 'within limits' (inside the size limits of "
        "[inspect] for the class 'anomaly'); absent otherwise."
    )


Task = Literal["detect", "segment", "classify", "anomaly"]
# 'uncertain': a part the model cannot tell: a classification model's best score below
# inspect.min_confidence, or a model's output broken (NaN, scores above 1) with nothing NG found.
Verdict = Literal["ok", "ng", "uncertain"]


class Reason(Message):
    """One detection (or a classification model's best class, or an anomaly model's score) that made the
    part NG or uncertain."""

    detection: int = Field(
        ge=0,
        description="Index into the detections message's detections; for a classification model, into its top (0); "
        "for an anomaly model (label 'anomaly score'), into its regions (0 when it has none).",
    )
    class_id: int = Field(ge=0)
    label: str
    score: float = Field(ge=0, le=1)
    zone: str | None = Field(description="The zone it is in; null when no zones are set.")


class ModelInfo(Message):
    name: str = Field(description="Model file name without extension.")
    sha256: str = Field(description="SHA-256 of the model file, hex.")
    provider: str = Field(
        description="What ran the model: the ONNX Runtime execution provider, or OpenVINO and its device (`OpenVINO CPU`)."
    )


class Timings(Message):
    preprocess_ms: float = Field(description="Letterbox, colour, layout and normalisation.")
    inference_ms: float = Field(description="ONNX Runtime run.")
    decode_ms: float = Field(description="Head decoding and NMS.")
    age_ms: float = Field(description="Capture to publish: how old the frame is when it goes out.")


class TopicMessage(Message):
    """What every message on a camera's topic starts with; each kind narrows ``kind`` to its name."""

    schema_version: Literal[2] = SCHEMA_VERSION
    kind: str
    camera_id: str
    seq: int = Field(
        ge=0,
        description="Per-topic sequence number, from 0 each time edged starts: a gap means messages were lost, "
        "a seq lower than the one before that edged started again.",
    )


class DetectionsMessage(TopicMessage):
    """One processed frame."""

    kind: Literal["detections"] = "detections"
    frame_id: int = Field(ge=0, description="Capture counter; gaps are frames dropped as stale.")
    capture_time_ns: int = Field(
        description="Wall-clock capture time, ns since the Unix epoch; above 2**53, so a JavaScript "
        "client should read capture_time_ms."
    )
    frame_size: tuple[int, int] = Field(description="Frame width, height in pixels.")
    input_size: tuple[int, int] = Field(description="Model input width, height in pixels.")
    model: ModelInfo
    task: Task = Field(
        "detect",
        description="The model's task: detect (detections), segment (detections with their outlines and sizes), "
        "classify (top, no detections) or anomaly (an anomaly score and regions, no detections).",
    )
    detections: list[Detection]
    top: list[TopClass] | None = Field(
        None,
        description="A classification model's best classes (model.top_k), best first; absent for other tasks.",
        exclude_if=lambda top: top is None,
    )
    anomaly_score: float | None = Field(
        None,
        ge=0,
        le=1,
        description="An anomaly model's image score, normalised as its export does (0.5: the exported threshold).",
        exclude_if=lambda value: value is None,
    )
    anomalous: bool | None = Field(
        None, description="Whether the anomaly score is above the threshold.", exclude_if=lambda value: value is None
    )
    threshold: float | None = Field(
        None,
        description="The anomaly score threshold used: model.anomaly_threshold, else the export's (0.5).",
        exclude_if=lambda value: value is None,
    )
    regions: list[AnomalyRegion] | None = Field(
        None,
        description="An anomaly model's regions: the connected components of its mask, largest first.",
        exclude_if=lambda value: value is None,
    )
    timings: Timings
    thermal_state: ThermalState = Field(description="The board's thermal state when the frame was processed.")
    verdict: Verdict | None = Field(
        None,
        description="ok or ng for this frame, or uncertain (a classification model's best score below "
        "inspect.min_confidence, or a model's output that held NaN or scores above 1 and nothing NG); null "
        "without [inspect].",
    )
    reasons: list[Reason] = Field(default_factory=list, description="The detections that made it ng.")
    verdict_latency_ms: float | None = Field(None, description="Capture to verdict; null without [inspect].")
    part_id: str | None = Field(None, description="The part id of the trigger request this frame answered.")
    source_file: str | None = Field(
        None,
        description="The image file the frame was read from (an images source: its name in the folder, or the "
        "path a glob matched); null for a camera or video.",
    )

    capture_time_ms = ms_copy("capture_time_ns")  # type: ignore[pydantic-field]  # a computed field: no annotation


class VerdictMessage(TopicMessage):
    """The verdict of one frame, and nothing else: what a PLC adapter acts on, without parsing boxes."""

    kind: Literal["verdict"] = "verdict"
    frame_id: int = Field(ge=0, description="The frame the verdict is on (its detections message has the same).")
    capture_time_ns: int = Field(description="Wall-clock capture time, ns since the Unix epoch.")
    part_id: str | None = Field(description="The trigger request's part id; null when free-running or none given.")
    verdict: Verdict
    reasons: list[Reason]
    top: list[TopClass] | None = Field(
        None,
        description="A classification model's best classes, as its detections message has them: what the part "
        "was taken for, an OK one's too; absent for other tasks.",
        exclude_if=lambda top: top is None,
    )
    verdict_latency_ms: float = Field(description="Capture to verdict.")
    source_file: str | None = Field(None, description="The image file the frame was read from; null for a camera.")
    model_sha256: str | None = Field(None, description="SHA-256 of the model file that gave the verdict, hex.")
    replayed: bool = Field(
        False,
        description="Sent from the journal after an outage (of the broker, the network or edged): recorded before "
        "the connection it came on. Only on MQTT, with the journal on.",
    )
    board_id: str | None = Field(
        None, description="The board, derived from its /etc/machine-id (not equal to it); stable across boots."
    )
    boot_id: str | None = Field(None, description="The kernel's id of the boot the board was in.")
    run_id: str | None = Field(
        None,
        description="This start of edged, a new random id each time it starts (seq starts again at 0): with "
        "camera_id and seq, what tells a message from one of an earlier start; null in a message recorded by "
        "an edged that did not send it.",
    )
    clock_synced: bool | None = Field(
        None, description="Whether the kernel said the clock was synchronised (NTP); null where it cannot tell."
    )

    capture_time_ms = ms_copy("capture_time_ns")  # type: ignore[pydantic-field]  # a computed field: no annotation


TriggerProblem = Literal["bad_request", "busy", "timeout", "camera_lost", "thermal_critical", "inference_failed", "stopping"]


class TriggerError(Message):
    """The reply to a trigger request that got no verdict, saying why."""

    schema_version: Literal[2] = SCHEMA_VERSION
    kind: Literal["trigger_error"] = "trigger_error"
    camera_id: str = Field(
        description="The camera the request was for; empty when it named none and several cameras take requests."
    )
    part_id: str | None
    error: TriggerProblem
    detail: str


MAX_PART_ID = 128
# The Unicode categories a part id may not hold: what would forge a line (NUL, newline, escape, the
# line separators) or reorder the text around it (bidirectional overrides, zero-width marks) in
# every subscriber, log and terminal it reaches; and lone surrogates, which UTF-8 cannot carry.
REFUSED_IN_PART_ID = {
    "Cc": "a control character",
    "Cf": "a format character",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
    "Cs": "a lone surrogate",
}


def first_refused(text: str, what: Callable[[str], str | None]) -> str | None:
    """The first character of ``text`` that ``what`` names (``"a control character"``), as an escape
    with its position (``U+000A at character 3 is a control character``); None when it holds none."""
    for i, c in enumerate(text):
        if (said := what(c)) is not None:
            return f"U+{ord(c):04X} at character {i + 1} is {said}"
    return None


def refused_character(text: str) -> str | None:
    """The first character of `REFUSED_IN_PART_ID` in ``text``, as `first_refused` names it."""
    return first_refused(text, lambda c: REFUSED_IN_PART_ID.get(unicodedata.category(c)))


def for_terminal(text: str) -> str:
    """``text`` as a terminal may be given it: control and format characters, line separators and lone
    surrogates escaped (``\\x1b``, ``\\u202e``), as `REFUSED_IN_PART_ID` names them. What a publisher,
    a request server or the journal gives ``edged subscribe``, ``trigger`` and ``history`` to print (a
    camera id, a class name, an image's file name) could otherwise move the cursor, clear the screen,
    retitle the window, forge lines or stop the printing (UTF-8 cannot carry a lone surrogate)."""
    if text.isprintable():  # the usual line: no character to look at twice
        return text
    return "".join(
        c.encode("unicode_escape", "backslashreplace").decode("ascii")
        if unicodedata.category(c) in REFUSED_IN_PART_ID
        else c
        for c in text
    )


class TriggerRequest(BaseModel):
    """What a trigger request says, on ZeroMQ or the broker's trigger topic: nothing else is accepted.

    Not a message edged publishes, so no envelope; an empty payload asks as ``{}`` does.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    part_id: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PART_ID,
        description="The part's id, carried into the verdict and detections messages; no control or "
        "format characters (Unicode Cc, Cf), line or paragraph separators.",
    )
    camera_id: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The camera to inspect with; may be left out when one camera takes requests. "
        "On the broker it must match the topic's camera.",
    )

    @field_validator("part_id", mode="before")
    @classmethod
    def _shown_as_written(cls, v: Any) -> Any:
        """Refuse `REFUSED_IN_PART_ID`, naming the first such character as an escape: the part id
        is shown to every subscriber and terminal, and the refusal is too."""
        if isinstance(v, str) and len(v) <= MAX_PART_ID:  # a longer one is refused for its length
            found = refused_character(v)
            if found is not None:
                raise ValueError(f"{found}, which a part id may not hold")
        return v


def parse_request(payload: bytes) -> TriggerRequest:
    """Validate a trigger request's payload; every rejection says why in one line (`MessageError`)."""
    if not payload.strip():
        return TriggerRequest()
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise MessageError('a request is JSON: {"part_id": "...", "camera_id": "..."}, both optional') from None
    if not isinstance(data, dict):
        raise MessageError(f"a request is a JSON object, not a {type(data).__name__}")
    try:
        return TriggerRequest.model_validate(data)
    except ValidationError as e:
        problem = e.errors()[0]
        key = str(problem["loc"][0]) if problem["loc"] else ""
        if problem["type"] == "extra_forbidden":
            raise MessageError(f'a request has the keys "part_id" and "camera_id" only, not {key!r:.80}') from None
        if key == "part_id" and problem["type"] == "value_error":
            raise MessageError(f"part_id: {problem['ctx']['error']}") from None
        if key == "part_id":
            raise MessageError(f"part_id must be a string of 1 to {MAX_PART_ID} characters") from None
        raise MessageError("camera_id must be a camera's name: 1 to 64 letters, digits, _ . -") from None


class StageLatency(Message):
    p50_ms: float
    p99_ms: float


class CaptureReport(Message):
    frames_captured: int = Field(ge=0, description="Frames taken off the camera since start.")
    frames_decoded: int = Field(ge=0, description="Of those, frames decoded (the rest were never wanted).")
    reconnects: int = Field(ge=0, description="Times the camera was reopened after being lost.")
    size_changes: int = Field(ge=0, description="Times the camera changed its frame size.")
    last_error: str | None = Field(description="The last camera error, null when none yet.")


class ThermalReadings(Message):
    """One poll of the board's sensors and the state edged decided on (`edged.thermal.ThermalReport`)."""

    state: ThermalState = Field(description="warm and throttled cap the frame rate; critical pauses inference.")
    board: str = Field(description="The board family the thresholds come from.")
    model: str | None = Field(description="The board's model string, null when unknown.")
    zones: dict[str, float] = Field(description="Temperature per thermal zone, C; offline sensors left out.")
    hottest_c: float | None = Field(description="The hottest zone, C; null without zones.")
    freq_cap_ratio: float | None = Field(
        description="The CPU frequency cap heat set, over the ceiling (1.0 for a ceiling set on purpose); null when unknown."
    )
    freq_cur_ratio: float | None = Field(description="Current CPU frequency over the maximum; null when unknown.")
    throttled_flags: list[str] = Field(description="The board's throttling flags now set (Raspberry Pi).")
    hardware_throttling: bool = Field(description="Whether the firmware or the kernel throttles now.")
    rate_factor: float = Field(description="Fraction of the full frame rate this state allows.")
    thresholds: dict[str, float] = Field(description="The temperatures of warm, throttled and critical, C.")
    power_mode: str | None = Field(description="The board's power mode (Jetson nvpmodel); null when none.")


class MemoryReadings(Message):
    """edged's cgroup: its memory limit and what edged uses of it, read each status round (`edged.memory`)."""

    limit_bytes: int = Field(
        gt=0, description="The cgroup's memory limit: MemoryMax= in the systemd unit, or a container's."
    )
    used_bytes: int = Field(
        ge=0,
        description="The cgroup's use less the page cache the kernel drops first (inactive files): what it "
        "would reclaim last. edged warns at 90 % of the limit; at the limit the kernel's OOM killer ends it.",
    )
    cgroup_bytes: int = Field(ge=0, description="The cgroup's use as the kernel counts it, page cache included.")
    oom_kills: int | None = Field(
        ge=0, description="Processes of the cgroup the kernel's OOM killer ended; null where the kernel does not say."
    )


class WriterReport(Message):
    """What a writer thread behind an output (evidence, the journal) says of the disk it writes to."""

    dropped: int = Field(ge=0, description="Items to write dropped because the disk fell too far behind.")
    errors: int = Field(ge=0, description="Writes or retention passes that failed (disk full, read-only, ...).")
    bytes: int = Field(ge=0, description="Bytes it holds on the disk.")
    last_error: str | None = Field(description="The last error, null when none yet.")


class EvidenceReport(WriterReport):
    saved: int = Field(ge=0, description="Frames saved as evidence since start.")
    rate_limited: int = Field(ge=0, description="Frames to save refused by evidence.max_per_minute.")


class JournalReport(WriterReport):
    path: str = Field(description="The journal file.")
    recorded: int = Field(ge=0, description="This camera's entries written to the journal since start.")
    unsent_deleted: int = Field(
        ge=0,
        description="Verdicts, of any camera, deleted to keep the journal under journal.max_bytes before the broker "
        "acknowledged them, since start: they will never be sent (a larger max_bytes holds a longer outage).",
    )


class RejectReport(Message):
    """The reject line of a camera: what it fired, and how close to its deadlines (over the last pulses)."""

    pulses: int = Field(ge=0, description="Pulses fired since start (merged ones count once).")
    late: int = Field(ge=0, description="Parts with no verdict by their deadline (capture + reject.delay_ms).")
    late_fired: int = Field(ge=0, description="Of those, parts rejected anyway (late = 'reject', the fail-safe).")
    late_verdicts: int = Field(ge=0, description="Verdicts that arrived after their part's deadline, and were ignored.")
    merged: int = Field(ge=0, description="Pulses merged into the one before (closer than reject.min_gap_ms).")
    dropped: int = Field(
        0,
        ge=0,
        description="Parts to be ejected whose pulse could not be fired: let go of by a line process that ended "
        "(a stop's bound, a signal, a failure) or judged while none was running. Each is logged.",
    )
    alarm: bool = Field(
        description="The alarm line is active: a deadline was missed (late = 'alarm'), or parts were dropped; "
        "until a verdict is on time again."
    )
    lateness_p50_ms: float = Field(
        description="Pulse start minus its target, median, over the pulses known before their target: the line's "
        "own delay (a part whose frame reached the model after its deadline is counted in late instead)."
    )
    lateness_p99_ms: float = Field(description="Pulse start minus its target, 99th percentile.")
    lateness_max_ms: float = Field(description="Pulse start minus its target, the worst.")
    margin_p1_ms: float | None = Field(
        description="Target minus verdict time, 1st percentile: how close verdicts come to their deadline; "
        "shrinking warns of late rejects. Null before the first verdict."
    )
    margin_p50_ms: float | None = Field(description="Target minus verdict time, median; null before the first verdict.")
    last_error: str | None = Field(description="The line's last error (its thread failed); null when none.")


ACCEPT_FAILED = (
    "Connections not taken for want of a file descriptor or memory (LimitNOFILE= reached, a descriptor leak), "
    "since start: each client waited in the listen backlog meanwhile."
)


class OpcuaReport(Message):
    """What the OPC UA server (``[opcua]``) says of itself; the same for every camera but ``updates``."""

    listen: str = Field(description="The address it listens on (opcua.listen).")
    serving: bool = Field(description="It listens and takes clients; false while it starts, or once it failed.")
    clients: int = Field(ge=0, description="Client connections now.")
    accept_failed: int = Field(ge=0, description=ACCEPT_FAILED)
    requests: int = Field(ge=0, description="Trigger calls answered since start, of every camera.")
    refused: int = Field(ge=0, description="Sign-ins refused since start (a wrong user or password).")
    updates: int = Field(ge=0, description="Verdicts written to the nodes since start, of every camera.")
    update_ms: StageLatency = Field(description="Capture to node update over the last verdicts, of every camera.")


CandidateState = Literal["on_trial", "failed", "live"]


class ClassAgreement(Message):
    matched: int = Field(ge=0, description="Boxes both models found (IoU 0.5 or more, same class).")
    live_only: int = Field(ge=0, description="Boxes the live model found and the candidate missed.")
    candidate_only: int = Field(ge=0, description="Boxes only the candidate found.")


class CandidateReport(Message):
    """The shadow trial of ``[model.candidate]``: how far it agrees with the live model on this line's frames."""

    state: CandidateState = Field(
        description="on_trial: runs beside the live model; failed: did not load (see error); live: promoted, "
        "the previous model kept for edged rollback."
    )
    model: ModelInfo | None = Field(description="The candidate (when live: the previous model); null when it failed.")
    error: str | None = Field(None, description="Why the candidate is not on trial, or its last failure.")
    frames: int = Field(ge=0, description="Live frames both models ran on and were compared, board-wide.")
    skipped_busy: int = Field(
        ge=0, description="Sampled frames the candidate never ran on: the loop had no headroom for it."
    )
    failed_frames: int = Field(ge=0, description="Sampled frames the candidate failed on (an error, or NaN output).")
    agreement: float | None = Field(
        description="Share of compared frames on which the models agree: the same verdict with [inspect] (a "
        "classifier's best class, an anomaly model's judgement without), else every box matched; null before the first."
    )
    verdicts: dict[str, int] = Field(
        description='Compared frames by "live/candidate" verdict (ok, ng, uncertain; without [inspect] a '
        "classifier's best class, an anomaly model's normal or anomalous, and none for a detector)."
    )
    classes: dict[str, ClassAgreement] = Field(description="Box agreement by class label.")
    score_shift: float | None = Field(description="Mean of candidate minus live score over matched boxes.")
    latency: StageLatency | None = Field(description="The candidate's own latency per frame (preprocess to decode).")
    disagreements_saved: int = Field(ge=0, description="Frames the models disagree on saved to evidence_dir.")
    gate: str | None = Field(description="Why promotion would be refused now; null once the gate is passed.")
    live_frames: int = Field(0, ge=0, description="Live frames published while the candidate was on trial, board-wide.")
    live_delayed: int = Field(
        0,
        ge=0,
        description="Of those, frames captured before a candidate run (or a sample copy) on the loop's thread "
        "ended and taken after it: frames that may have waited for the trial.",
    )
    live_delay_ms: float | None = Field(
        None,
        ge=0,
        description="Frame age the trial added per live frame, averaged over all live_frames: an upper bound "
        "(the loop might have been busy anyway), free of run-to-run noise; null before the first.",
    )
    live_delay: StageLatency | None = Field(
        None, description="Frame age the trial added to each delayed frame (p50, p99); null before the first."
    )


class ModbusReport(Message):
    """The Modbus TCP server's counters (`edged.modbus`), the board's: every camera's status says the same."""

    clients: int = Field(ge=0, description="Clients connected now.")
    accept_failed: int = Field(ge=0, description=ACCEPT_FAILED)
    requests: int = Field(ge=0, description="Requests answered since start, exceptions included.")
    exceptions: int = Field(ge=0, description="Requests answered with a Modbus exception (bad address, unit, function).")
    refused: int = Field(ge=0, description="Connections closed as they came, beyond modbus.max_connections.")
    unread: int = Field(ge=0, description="Connections closed for leaving their answers unread.")
    reclaimed: int = Field(
        ge=0, description="Silent connections closed to make room for a new client (modbus.reclaim_idle_s)."
    )
    triggers: int = Field(ge=0, description="Inspection requests taken through a coil.")


class StatusMessage(TopicMessage):
    """Periodic health: published even when no frames flow (camera lost, thermal pause)."""

    kind: Literal["status"] = "status"
    time_ns: int = Field(
        description="Wall-clock time of this status, ns since the Unix epoch; above 2**53, so a "
        "JavaScript client should read time_ms."
    )
    uptime_s: float
    fps: float = Field(description="Frames processed per second over the last interval.")
    frames_processed: int
    source_state: CaptureState = Field(description="The camera: starting, ok, lost or ended (a finite file).")
    drops: dict[str, int] = Field(description="Frames or messages not processed or sent, by cause.")
    latency: dict[str, StageLatency] = Field(description="Per stage over the last interval.")
    rate_cap_fps: float | None = Field(description="Current frame-rate cap; null when uncapped.")
    thermal: ThermalReadings | None = Field(description="Thermal readings and state; null when off.")
    model: ModelInfo
    capture: CaptureReport | None = Field(None, description="The camera's counters (added in edged 0.2).")
    evidence: EvidenceReport | None = Field(None, description="The evidence writer's counters; null without [evidence].")
    board_id: str | None = Field(
        None, description="The board, derived from its /etc/machine-id (not equal to it); stable across boots."
    )
    boot_id: str | None = Field(None, description="The kernel's id of the boot the board was in.")
    run_id: str | None = Field(
        None,
        description="This start of edged, a new random id each time it starts (seq starts again at 0): with "
        "camera_id and seq, what tells a message from one of an earlier start; null in a message recorded by "
        "an edged that did not send it.",
    )
    clock_synced: bool | None = Field(
        None, description="Whether the kernel said the clock was synchronised (NTP); null where it cannot tell."
    )
    journal: JournalReport | None = Field(
        None, description="The verdict journal's counters; null when it records nothing of this camera."
    )
    reject: RejectReport | None = Field(None, description="The reject line's counters; null without [reject].")
    mqtt_state: Literal["connected", "disconnected"] | None = Field(
        None, description="The MQTT output's link to its broker; null when [mqtt] is off."
    )
    mqtt_drops: dict[str, int] | None = Field(
        None,
        description="MQTT messages dropped or superseded while the broker was away, by topic "
        "(detections, status, verdict); null when [mqtt] is off.",
    )
    candidate: CandidateReport | None = Field(None, description="The shadow trial; null without [model.candidate].")
    memory: MemoryReadings | None = Field(
        None,
        description="edged's memory limit and use (its cgroup's); null without a limit (MemoryMax=) or where the "
        "cgroup cannot be read.",
    )

    opcua: OpcuaReport | None = Field(
        None, description="The OPC UA server's clients and counters; null when [opcua] is off."
    )
    modbus: ModbusReport | None = Field(None, description="The Modbus TCP server's counters; null when [modbus] is off.")

    time_ms = ms_copy("time_ns")  # type: ignore[pydantic-field]  # a computed field: no annotation


EVOLUTION = (
    "Later releases may add fields without changing schema_version: ignore the ones you do not know. "
    "schema_version changes when a field is removed, renamed, changes type or meaning, or an enum gains a value. "
    "The *_ns integers exceed 2**53: JavaScript should read the *_ms copies."
)


def json_schema() -> dict[str, Any]:
    """The schema subscribers use: one document describing every message kind, and in its
    ``$defs`` the trigger request edged takes (`TriggerRequest`)."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "edged messages",
        "description": f"{__doc__.strip().splitlines()[0]} Schema version {SCHEMA_VERSION}. {EVOLUTION}",
        "oneOf": [{"$ref": f"#/$defs/{kind.__name__}"} for kind in _KINDS.values()],
        "$defs": _merged_defs(*_KINDS.values(), TriggerRequest),
    }


def _merged_defs(*models: type[BaseModel]) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/$defs/{model}", mode="serialization")
        defs.update(schema.pop("$defs", {}))
        defs[model.__name__] = schema
    return dict(sorted(defs.items()))


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


MAX_PAYLOAD_BYTES = 1 << 20  # a detections message is a few KB; anything this big is not ours


AnyMessage = DetectionsMessage | StatusMessage | VerdictMessage | TriggerError

_KINDS: dict[str, type[AnyMessage]] = {
    "detections": DetectionsMessage,
    "status": StatusMessage,
    "verdict": VerdictMessage,
    "trigger_error": TriggerError,
}


def _holds_lone_surrogate(data: object) -> bool:
    """Whether a string in ``data`` holds a lone surrogate: JSON's ``\\udc80`` escape decodes to one, no
    edged sends it, and a message holding one could be neither printed nor written as JSON again
    (``edged subscribe`` ended with a traceback, as would any application re-sending it)."""
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    except RecursionError:  # nested too deep to write again: the message's validation refuses it
        return False
    return False


def parse_message(payload: bytes) -> AnyMessage:
    """Validate a received payload; every rejection says why in one line."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MessageError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MessageError(f"payload is not JSON: {str(e)[:120]}") from None
    if not isinstance(data, dict):
        raise MessageError(f"payload is a JSON {type(data).__name__}, not an object")
    if b"\\u" in payload and _holds_lone_surrogate(data):  # only an escape can make one
        raise MessageError("payload holds a lone surrogate (a \\udXXX escape alone), which no UTF-8 text can carry")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise MessageError(f"schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")
    kind = data.get("kind")
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise MessageError(f"unknown message kind {kind!r:.80}")
    try:
        return model.model_validate(data)
    except ValueError as e:
        first = str(e).splitlines()
        raise MessageError(f"invalid {data['kind']} message: {' '.join(first[:3])[:300]}") from None
