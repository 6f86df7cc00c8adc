"""The wire schema: generated from the models, committed, and enforced on the receiving side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edged.errors import MessageError
from edged.messages import MAX_PAYLOAD_BYTES, DetectionsMessage, StatusMessage, json_schema, parse_message, schema_text

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
    assert schema["$defs"]["DetectionsMessage"]["properties"]["schema_version"]["const"] == 1


def test_round_trip() -> None:
    msg = sample()
    assert parse_message(msg.model_dump_json().encode()) == msg


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xff\xfe", "not JSON"),  # not UTF-8
        (b"{", "not JSON"),  # truncated
        (b"[1, 2]", "JSON list, not an object"),
        (b'{"schema_version": 2, "kind": "detections"}', "schema_version 2 is not supported"),
        (b'{"kind": "detections"}', "schema_version None"),
        (b'{"schema_version": 1, "kind": "video"}', "unknown message kind 'video'"),
        (b'{"schema_version": 1, "kind": "status"}', "invalid status message"),
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
    data = json.loads(sample().model_dump_json())
    data["extra_field"] = 1
    with pytest.raises(MessageError):
        parse_message(json.dumps(data).encode())


def test_status_message_parses() -> None:
    status = StatusMessage.model_validate(
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
    assert parse_message(status.model_dump_json().encode()) == status
