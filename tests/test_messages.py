"""The wire schema: generated from the models, committed, and enforced on the receiving side."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, get_args

import pytest
from jsonschema import Draft202012Validator

from edged.errors import MessageError
from edged.messages import (
    MAX_PAYLOAD_BYTES,
    SCHEMA_VERSION,
    CaptureState,
    DetectionsMessage,
    StatusMessage,
    ThermalReadings,
    ThermalState,
    TriggerRequest,
    json_schema,
    parse_message,
    parse_request,
    schema_text,
)
from edged.thermal import ThermalReport

SCHEMA_FILE = Path(__file__).parent.parent / "edged" / "messages.schema.json"


def sample() -> DetectionsMessage:
    return DetectionsMessage.model_validate(
        {
            "camera_id": "cam0",
            "seq": 3,
            "frame_id": 7,
            "capture_time_ns": 1_700_000_000_000_000_000,
            "frame_size": [1280, 720],
            "input_size": [320, 320],
            "model": {"name": "demo", "sha256": "ab" * 32, "provider": "CPUExecutionProvider"},
            "detections": [{"class_id": 1, "label": "spot", "score": 0.9, "box": [1, 2, 30, 40]}],
            "timings": {"preprocess_ms": 0.4, "inference_ms": 5.0, "decode_ms": 0.1, "age_ms": 7.0},
            "thermal_state": "ok",
        }
    )


def test_committed_schema_is_current() -> None:
    assert SCHEMA_FILE.read_text() == schema_text(), "run `edged schema --out edged/messages.schema.json`"


def test_schema_describes_both_kinds() -> None:
    schema = json_schema()
    assert {"DetectionsMessage", "StatusMessage", "Detection"} <= set(schema["$defs"])
    assert schema["$defs"]["DetectionsMessage"]["properties"]["schema_version"]["const"] == SCHEMA_VERSION == 2


def test_round_trip() -> None:
    msg = sample()
    assert parse_message(msg.model_dump_json().encode()) == msg


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xff\xfe", "not JSON"),  # not UTF-8
        (b"{", "not JSON"),  # truncated
        (b"[1, 2]", "JSON list, not an object"),
        (b'{"schema_version": 1, "kind": "detections"}', "schema_version 1 is not supported"),  # 0.4.0's
        (b'{"schema_version": 3, "kind": "detections"}', "schema_version 3 is not supported"),
        (b'{"kind": "detections"}', "schema_version None"),
        (b'{"schema_version": 2, "kind": "video"}', "unknown message kind 'video'"),
        (b'{"schema_version": 2, "kind": "status"}', "invalid status message"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),  # nesting bomb
        (b" " * (MAX_PAYLOAD_BYTES + 1), "exceeds"),  # oversized
    ],
)
def test_malformed_payloads_are_rejected_with_a_reason(payload: bytes, message: str) -> None:
    with pytest.raises(MessageError, match=message):
        parse_message(payload)


def test_wrong_field_types_are_rejected() -> None:
    data = json.loads(sample().model_dump_json())
    data["detections"][0]["score"] = 3.0
    with pytest.raises(MessageError, match="invalid detections message"):
        parse_message(json.dumps(data).encode())


def status_sample() -> StatusMessage:
    return StatusMessage.model_validate(
        {
            "camera_id": "cam0",
            "seq": 0,
            "time_ns": 1,
            "uptime_s": 1.0,
            "fps": 10.0,
            "frames_processed": 10,
            "source_state": "ok",
            "drops": {"stale": 2},
            "latency": {"inference": {"p50_ms": 1, "p99_ms": 2}},
            "rate_cap_fps": None,
            "thermal": None,
            "model": {"name": "demo", "sha256": "00", "provider": "CPUExecutionProvider"},
        }
    )


def test_status_message_parses() -> None:
    status = status_sample()
    assert parse_message(status.model_dump_json().encode()) == status


# ---- the committed schema, read by an independent validator -----------------------------------


def committed_schema() -> Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def edged_accepts(doc: dict[str, Any]) -> bool:
    try:
        parse_message(json.dumps(doc).encode())
    except MessageError:
        return False
    return True


def _without(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != key}


MESSAGES = {"detections": sample, "status": status_sample}


@pytest.mark.parametrize("kind", MESSAGES)
def test_schema_and_parser_agree_on_what_is_required_closed_and_open(kind: str) -> None:
    validator = committed_schema()
    doc = json.loads(MESSAGES[kind]().model_dump_json())
    state = "thermal_state" if kind == "detections" else "source_state"
    cases = {
        "as published": (doc, True),
        "without schema_version": (_without(doc, "schema_version"), False),
        "without kind": (_without(doc, "kind"), False),
        "without camera_id": (_without(doc, "camera_id"), False),
        f"{state} outside its enum": ({**doc, state: "melting"}, False),
        "a field a later release adds": ({**doc, "added_later": {"any": ["thing"]}}, True),
        "a newer schema_version": ({**doc, "schema_version": 3}, False),
    }
    for case, (payload, accepted) in cases.items():
        assert validator.is_valid(payload) is accepted, case
        assert edged_accepts(payload) is accepted, case


def test_every_state_edged_can_publish_is_in_the_schema() -> None:
    defs = json.loads(SCHEMA_FILE.read_text())["$defs"]
    assert defs["DetectionsMessage"]["properties"]["thermal_state"]["enum"] == list(get_args(ThermalState))
    assert defs["StatusMessage"]["properties"]["source_state"]["enum"] == list(get_args(CaptureState))
    assert get_args(ThermalState) == ("unknown", "ok", "warm", "throttled", "critical")
    assert get_args(CaptureState) == ("starting", "ok", "lost", "ended")


def test_the_thermal_report_the_daemon_sends_is_the_schema_s_thermal_readings() -> None:
    report = ThermalReport(
        state="throttled",
        board="jetson",
        zones={"cpu-thermal": 81.5, "gpu-thermal": 79.0},
        hottest_c=81.5,
        freq_cap_ratio=0.6,
        throttled_flags=("soft_temp_limit",),
        rate_factor=0.25,
        thresholds={"warm_c": 70.0, "throttled_c": 80.0, "critical_c": 90.0},
        model="NVIDIA Jetson Orin Nano",
        freq_cur_ratio=0.55,
        power_mode="15W",
        hardware_throttling=True,
    )
    status = status_sample().model_copy(update={"thermal": ThermalReadings.model_validate(report.to_dict())})
    doc = json.loads(status.model_dump_json())
    assert doc["thermal"] == json.loads(json.dumps(report.to_dict()))  # every key of the report, none lost
    validator = committed_schema()
    assert validator.is_valid(doc) and edged_accepts(doc)
    hot = {**doc, "thermal": {**doc["thermal"], "state": "molten"}}
    assert not validator.is_valid(hot) and not edged_accepts(hot)


def test_nanosecond_times_have_a_millisecond_copy_a_double_holds() -> None:
    ns = 1_764_763_200_123_456_789  # beyond 2**53: a double (JavaScript's number) rounds it
    assert float(ns) != ns
    detections = json.loads(sample().model_copy(update={"capture_time_ns": ns}).model_dump_json())
    status = json.loads(status_sample().model_copy(update={"time_ns": ns}).model_dump_json())
    # Read as JavaScript reads them: one double each, within a microsecond of the exact time.
    assert abs(detections["capture_time_ms"] * 1e6 - ns) < 1_000
    assert abs(status["time_ms"] * 1e6 - ns) < 1_000
    validator = committed_schema()
    assert validator.is_valid(detections) and validator.is_valid(status)
    # On the way in the copy is derived again, never trusted.
    tampered = parse_message(json.dumps({**detections, "capture_time_ms": 0.0}).encode())
    assert isinstance(tampered, DetectionsMessage) and tampered.capture_time_ms == detections["capture_time_ms"]


def test_a_part_id_may_not_hold_control_format_or_separator_characters() -> None:
    # The MQTT trigger topic and the ZeroMQ socket parse with parse_request, edged trigger builds the request.
    for payload, named in (
        (b'{"part_id": "A\\r1"}', "U+000D at character 2 is a control character"),
        (b'{"part_id": "A\\u202e1"}', "U+202E at character 2 is a format character"),
        (b'{"part_id": "\\u2029"}', "U+2029 at character 1 is a paragraph separator"),
        (b'{"part_id": "\\udfff"}', "U+DFFF at character 1 is a lone surrogate"),
    ):
        with pytest.raises(MessageError, match=f"^{re.escape(f'part_id: {named}, which a part id may not hold')}$"):
            parse_request(payload)
    assert parse_request('{"part_id": "Ä 部品-1"}'.encode()).part_id == "Ä 部品-1"
    with pytest.raises(ValueError, match="U\\+0009"):
        TriggerRequest(part_id="A\t1")
    with pytest.raises(MessageError, match="1 to 128 characters"):  # too long, whatever it holds
        parse_request(b'{"part_id": "' + b"\\n" * 200 + b'"}')
