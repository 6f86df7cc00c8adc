"""Fuzzing the subscriber's parser: whatever arrives on the wire, the result is a valid message or
a one-line `MessageError`, never another exception that would kill a consumer's receive loop.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.errors import MessageError
from edged.messages import (
    MAX_PAYLOAD_BYTES,
    SCHEMA_VERSION,
    Detection,
    DetectionsMessage,
    ModelInfo,
    StageLatency,
    StatusMessage,
    ThermalReadings,
    Timings,
    parse_message,
)
from edged.subscribe import Subscriber

FUZZ = settings(max_examples=200, deadline=None)
MODEL = ModelInfo(name="probe", sha256="ab" * 32, provider="CPUExecutionProvider")
VALID = [
    DetectionsMessage(
        camera_id="cam0",
        seq=7,
        frame_id=9,
        capture_time_ns=1_700_000_000_000_000_000,
        frame_size=(128, 96),
        input_size=(64, 64),
        model=MODEL,
        thermal_state="ok",
        detections=[Detection(class_id=1, label="blue", score=0.86, box=(48.0, 20.0, 80.0, 44.0))],
        timings=Timings(preprocess_ms=0.4, inference_ms=1.2, decode_ms=0.1, age_ms=3.5),
    ),
    StatusMessage(
        camera_id="cam0",
        seq=3,
        time_ns=1,
        uptime_s=2.5,
        fps=14.9,
        frames_processed=40,
        source_state="ok",
        drops={"stale": 2},
        latency={"inference": StageLatency(p50_ms=1.0, p99_ms=2.0)},
        rate_cap_fps=None,
        thermal=ThermalReadings(
            state="ok",
            board="raspberrypi",
            model=None,
            zones={"cpu": 51.2},
            hottest_c=51.2,
            freq_cap_ratio=1.0,
            freq_cur_ratio=None,
            throttled_flags=[],
            hardware_throttling=False,
            rate_factor=1.0,
            thresholds={"warm_c": 70.0, "throttled_c": 80.0, "critical_c": 85.0},
            power_mode=None,
        ),
        model=MODEL,
    ),
]

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


def outcome(payload: bytes) -> DetectionsMessage | StatusMessage | MessageError:
    """What the parser makes of ``payload``; any other exception fails the test right here."""
    try:
        return parse_message(payload)
    except MessageError as e:
        text = str(e)
        assert text and "\n" not in text and "\r" not in text, repr(text)
        return e


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


@pytest.mark.parametrize("msg", VALID, ids=lambda m: m.kind)
def test_valid_messages_parse_back_to_themselves(msg: DetectionsMessage | StatusMessage) -> None:
    assert parse_message(msg.model_dump_json().encode()) == msg
    assert Subscriber.parse([f"edged/{msg.kind}/cam0".encode(), msg.model_dump_json().encode()]) == msg


@FUZZ
@given(payload=st.binary(max_size=300))
def test_random_bytes(payload: bytes) -> None:
    outcome(payload)


@FUZZ
@given(value=JSON)
def test_valid_json_of_any_shape(value: Any) -> None:
    assert isinstance(outcome(_dumps(value)), MessageError)


@FUZZ
@given(msg=st.sampled_from(VALID), version=JSON, kind=JSON)
def test_wrong_schema_versions_and_kinds(msg: DetectionsMessage | StatusMessage, version: Any, kind: Any) -> None:
    data = msg.model_dump(mode="json") | {"schema_version": version, "kind": kind}
    result = outcome(_dumps(data))
    if isinstance(result, MessageError):
        return
    assert result.schema_version == SCHEMA_VERSION and result.kind == kind  # only the real pair can pass


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a dict key or list item inside ``value``."""
    found = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        found.append((*prefix, key))
        found += _paths(child, (*prefix, key))
    return found


def _parent(data: Any, path: tuple[Any, ...]) -> Any:
    for key in path[:-1]:
        data = data[key]
    return data


@FUZZ
@given(
    msg=st.sampled_from(VALID),
    data=st.data(),
    mutation=st.sampled_from(["drop", "rename", "retype", "duplicate"]),
    replacement=JSON,
)
def test_mutations_of_a_valid_message(
    msg: DetectionsMessage | StatusMessage, data: st.DataObject, mutation: str, replacement: Any
) -> None:
    doc = msg.model_dump(mode="json")
    path = data.draw(st.sampled_from(_paths(doc)))
    parent, key = _parent(doc, path), path[-1]
    if mutation == "drop":
        del parent[key]
    elif mutation == "rename" and isinstance(parent, dict):
        parent[key + data.draw(st.text(min_size=1, max_size=5))] = parent.pop(key)
    elif mutation == "duplicate" and isinstance(parent, list):
        parent.append(parent[key])
    else:
        parent[key] = replacement
    result = outcome(_dumps(doc))
    if not isinstance(result, MessageError):
        assert type(result) is type(msg)


@FUZZ
@given(
    msg=st.sampled_from(VALID),
    cut=st.integers(min_value=0, max_value=2000),
    flip=st.integers(min_value=0, max_value=2000),
    byte=st.integers(0, 255),
)
def test_truncated_and_corrupted_payloads(msg: DetectionsMessage | StatusMessage, cut: int, flip: int, byte: int) -> None:
    payload = bytearray(msg.model_dump_json().encode())
    outcome(bytes(payload[:cut]))
    payload[flip % len(payload)] = byte
    outcome(bytes(payload))


@pytest.mark.parametrize("depth", [10, 1_000, 100_000])
@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_deep_nesting(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    assert isinstance(outcome((opener * depth + "1" + closer * depth).encode()), MessageError)
    doc = VALID[1].model_dump(mode="json")
    doc["thermal"] = json.loads("[" * min(depth, 500) + "]" * min(depth, 500))
    assert isinstance(outcome(_dumps(doc)), MessageError)


def test_oversized_payloads_are_refused_before_parsing() -> None:
    error = outcome(b" " * MAX_PAYLOAD_BYTES + b"{}")
    assert isinstance(error, MessageError) and "exceeds" in str(error)
    padded = VALID[0].model_dump_json()[:-1] + ', "pad": "' + "x" * MAX_PAYLOAD_BYTES + '"}'
    assert "exceeds" in str(outcome(padded.encode()))


def test_huge_numbers_and_strings_stay_one_line() -> None:
    for value in ("9" * 4301, '"' + "\\n" * 10_000 + '"', "1e999", "-1e999", "NaN"):
        outcome(f'{{"schema_version": {SCHEMA_VERSION}, "kind": "status", "seq": {value}}}'.encode())
        outcome(f'{{"schema_version": {SCHEMA_VERSION}, "kind": {value}}}'.encode())


@FUZZ
@given(frames=st.lists(st.binary(max_size=50), max_size=5))
def test_subscriber_parse_with_any_frames(frames: list[bytes]) -> None:
    try:
        Subscriber.parse(frames)
    except MessageError as e:
        assert "\n" not in str(e)
        if len(frames) != 2:
            assert str(e) == f"expected 2 frames (topic, payload), got {len(frames)}"
