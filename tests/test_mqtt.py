"""The MQTT output's settings and outbox: every key documented, bad settings named, the outbox bounded.

The broker side (topics, Last Will, outages, credentials, TLS, a fleet) is in test_mqtt_broker.py.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import paho.mqtt
import pytest

from edged.config import load_config
from edged.errors import ConfigError
from edged.mqtt import INSTALL_PAHO, MAX_REFUSALS, Outbox, PacketCap, new_client
from edged.settings.mqtt import MqttConfig, topic_hostname

EXAMPLE = Path(__file__).parent.parent / "config" / "edged.toml"


def _config(tmp_path: Path, mqtt: str) -> Path:
    (tmp_path / "m.onnx").write_bytes(b"x")
    path = tmp_path / "edged.toml"
    path.write_text(f'[model]\npath = "m.onnx"\n[mqtt]\n{mqtt}\n')
    return path


def _problems(tmp_path: Path, mqtt: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(_config(tmp_path, mqtt))
    return info.value.problems


def test_every_mqtt_key_is_documented_in_the_example_config() -> None:
    text = EXAMPLE.read_text()
    section = text[text.index("# [mqtt]") :]
    documented = set(re.findall(r"^#\s*([a-z_]+)\s*=", section, re.MULTILINE))
    assert set(MqttConfig.model_fields) <= documented, set(MqttConfig.model_fields) - documented


def test_defaults_are_stable_per_host_and_camera(tmp_path: Path) -> None:
    settings = load_config(_config(tmp_path, 'url = "mqtt://broker.local"'))
    cfg = settings.mqtt
    assert cfg is not None and (cfg.host, cfg.port, cfg.tls) == ("broker.local", 1883, False)
    assert cfg.prefix() == f"edged/{topic_hostname()}" and cfg.client_id_for("cam0") == f"edged-{topic_hostname()}-cam0"
    assert (cfg.qos_detections, cfg.qos_events, cfg.publish_empty) == (0, 1, False)
    tls = MqttConfig(url="mqtts://[::1]")
    assert (tls.host, tls.port, tls.tls) == ("::1", 8883, True)
    assert load_config(_config(tmp_path, 'url = "mqtt://b"')).mqtt is not None
    (tmp_path / "edged.toml").write_text('[model]\npath = "m.onnx"\n')
    assert load_config(tmp_path / "edged.toml").mqtt is None


def test_the_environment_can_turn_it_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "edged.toml").write_text('[model]\npath = "m.onnx"\n')
    (tmp_path / "m.onnx").write_bytes(b"x")
    monkeypatch.setenv("EDGED_MQTT__URL", "mqtts://broker:8884")
    settings = load_config(tmp_path / "edged.toml")
    assert settings.mqtt is not None and (settings.mqtt.host, settings.mqtt.port) == ("broker", 8884)


@pytest.mark.parametrize(
    ("mqtt", "problem"),
    [
        ('url = "tcp://broker:1883"', "mqtt.url: Value error, must start with mqtt:// or mqtts://"),
        ('url = "mqtt://user:pw@broker"', "must not hold credentials: set mqtt.username and mqtt.password_file"),
        ('url = "mqtt://broker:99999"', "mqtt.url"),
        ('url = "mqtt://broker:0"', "mqtt.url: Value error, port 0 is no broker's port"),
        ('url = "mqtts://broker:0"', "leave the port out for 8883"),
        ('url = "mqtt://broker/edged"', "nothing after the port"),
        ('url = "mqtt://b"\nca_file = "ca.crt"', "ca_file, cert_file and key_file need an mqtts:// url"),
        ('url = "mqtts://b"\ncert_file = "c.crt"', "set both cert_file and key_file, or neither"),
        ('url = "mqtt://b"\npassword_file = "pw"', "password_file needs a username"),
        ('url = "mqtt://b"\ntopic_prefix = "edged/#"', "mqtt.topic_prefix: String should match"),
        ('url = "mqtt://b"\ntopic_prefix = "/edged"', "mqtt.topic_prefix"),
        ('url = "mqtt://b"\nqos_detections = 3', "mqtt.qos_detections"),
        ('url = "mqtt://b"\nmax_queued = 0', "mqtt.max_queued"),
        ('url = "mqtt://b"\npassword = "s3cret"', "mqtt.password: Extra inputs are not permitted"),
        ('url = "mqtts://b"\nca_file = "missing.crt"', "mqtt.ca_file: "),
    ],
)
def test_bad_settings_name_their_key(tmp_path: Path, mqtt: str, problem: str) -> None:
    problems = _problems(tmp_path, mqtt)
    assert any(problem in p for p in problems), problems


def test_a_ca_file_that_is_a_directory_is_named_as_one(tmp_path: Path) -> None:
    (tmp_path / "certs").mkdir()
    problems = _problems(tmp_path, 'url = "mqtts://b"\nca_file = "certs"')
    assert any(re.search(r"mqtt.ca_file: .*certs is a directory, not a file", p) for p in problems), problems
    assert not any("does not exist" in p for p in problems), problems


def test_a_password_file_others_can_read_is_refused_and_one_for_the_service_group_is_not(tmp_path: Path) -> None:
    secret = tmp_path / "mqtt.password"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    mqtt = 'url = "mqtt://b"\nusername = "line3"\npassword_file = "mqtt.password"'
    problems = _problems(tmp_path, mqtt)
    assert any(re.search(r"mqtt.password_file: permissions 0644 .* too open.*chmod 640", p) for p in problems), problems
    secret.chmod(0o660)  # group-writable: refused too
    assert any("permissions 0660" in p for p in _problems(tmp_path, mqtt))
    secret.chmod(0o640)
    settings = load_config(tmp_path / "edged.toml")
    assert settings.mqtt is not None and settings.mqtt.password_file == secret  # relative to the config file
    assert any(
        "mqtt.password_file: " in p and "does not exist" in p
        for p in _problems(tmp_path, mqtt.replace("mqtt.password", "gone"))
    )


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("mqtt://broker.plant:1883", True),
        ("mqtt://10.0.0.5", True),
        ("mqtt://127.0.0.1", False),
        ("mqtt://localhost", False),
    ],
)
def test_a_password_sent_in_the_clear_off_this_machine_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, url: str, said: bool
) -> None:
    secret = tmp_path / "mqtt.password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    cfg = MqttConfig(url=url, username="line3", password_file=secret)
    with caplog.at_level(logging.WARNING, logger="edged.mqtt"):
        new_client(cfg, "edged-cam0")
        new_client(cfg.model_copy(update={"url": url.replace("mqtt://", "mqtts://")}), "edged-cam0")  # TLS: nothing
    warned = [r.getMessage() for r in caplog.records if "in the clear" in r.getMessage()]
    assert warned == (
        [
            f"mqtt: line3's password goes to {cfg.where} in the clear (mqtt://): anyone on the network "
            "between can read it; use mqtts://"
        ]
        if said
        else []
    )


def test_without_paho_an_mqtt_section_is_a_config_error_saying_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "paho.mqtt.client", None)  # as if paho-mqtt were not installed
    problems = _problems(tmp_path, 'url = "mqtt://b"')
    assert any("mqtt: " in p and INSTALL_PAHO in p for p in problems), problems
    assert ".venv/bin/python -m pip install -e '.[mqtt]'" in INSTALL_PAHO  # a checkout: edged is not on PyPI
    assert "sudo apt install python3-paho-mqtt" in INSTALL_PAHO  # the .deb's Recommends
    assert "sudo pip --python /usr/lib/edged/venv/bin/python install 'paho-mqtt>=2,<3'" in INSTALL_PAHO


def test_paho_1_is_refused_with_the_version_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paho.mqtt, "__version__", "1.6.1")  # Debian bookworm's python3-paho-mqtt
    problems = _problems(tmp_path, 'url = "mqtt://b"')
    assert any("needs paho-mqtt 2.x, this Python has 1.6.1: " + INSTALL_PAHO in p for p in problems), problems


def _drain(box: Outbox) -> list[tuple[str, bytes]]:
    out = []
    while (item := box.take()) is not None:
        out.append((item.kind, item.payload))
    return out


def test_the_outbox_holds_events_before_detections_and_drops_the_oldest_detections_first() -> None:
    box = Outbox(limit=3)
    box.put("detections", b"d1", "cam0")
    box.put("verdict", b"v1", "cam0")
    box.put("detections", b"d2", "cam0")
    box.put("detections", b"d3", "cam0")  # over the limit: d1, the oldest detection, goes
    box.put("verdict", b"v2", "cam0")  # d2 goes
    assert box.counts() == {"detections": 2, "status": 0, "verdict": 0, "trigger/error": 0, "trigger": 0, "refusals": 0}
    assert _drain(box) == [("verdict", b"v1"), ("verdict", b"v2"), ("detections", b"d3")]


def test_the_outbox_drops_the_oldest_event_only_when_no_detection_is_left() -> None:
    box = Outbox(limit=2)
    for i in range(5):
        box.put("verdict", f"v{i}".encode(), "cam0")
    assert box.counts() == {"detections": 0, "status": 0, "verdict": 3, "trigger/error": 0, "trigger": 0, "refusals": 0}
    assert _drain(box) == [("verdict", b"v3"), ("verdict", b"v4")]


def test_only_the_newest_status_waits_and_goes_first() -> None:
    box = Outbox(limit=10)
    box.put("detections", b"d1", "cam0")
    for i in range(4):
        box.put("status", f"s{i}".encode(), "cam0")
    assert box.counts() == {"detections": 0, "status": 3, "verdict": 0, "trigger/error": 0, "trigger": 0, "refusals": 0}
    first = box.take()
    assert first is not None and (first.kind, first.payload) == ("status", b"s3")
    box.put_back(first)  # the client could not take it: it waits at the front again
    assert _drain(box) == [("status", b"s3"), ("detections", b"d1")]


def test_trigger_errors_are_events_and_refused_triggers_are_counted_under_their_topic() -> None:
    box = Outbox(limit=2)
    box.put("detections", b"d1", "cam0")
    box.put("trigger/error", b"e1", "cam0")
    box.put("detections", b"d2", "cam0")  # over the limit: d1 goes, the error stays
    box.refused("trigger")
    box.refused("trigger")
    assert box.counts() == {"detections": 1, "status": 0, "verdict": 0, "trigger/error": 0, "trigger": 2, "refusals": 0}
    assert _drain(box) == [("trigger/error", b"e1"), ("detections", b"d2")]


def test_replies_to_refused_requests_wait_apart_and_never_push_out_verdicts_or_detections() -> None:
    box = Outbox(limit=3)
    box.put("verdict", b"v1", "cam0")
    box.put("detections", b"d1", "side")
    for i in range(MAX_REFUSALS + 5):  # a flood of busy replies: the oldest five go, counted apart
        box.put_refusal(f"busy{i}".encode(), "cam0")
    box.put("trigger/error", b"timeout", "cam0")  # a request's answer: an event, as ever
    assert box.counts() == {"detections": 0, "status": 0, "verdict": 0, "trigger/error": 0, "trigger": 0, "refusals": 5}
    first = box.take()
    assert first is not None and (first.kind, first.payload) == ("verdict", b"v1")
    held = [first, *iter(box.take, None)]
    assert [item.payload for item in held[:4]] == [b"v1", b"timeout", b"busy5", b"busy6"]
    assert held[-1].payload == b"d1" and len(held) == MAX_REFUSALS + 3
    box.put_back(held[2])  # the client could not take it: first in its own line again
    box.put("detections", b"d2", "side")
    assert [item.payload for item in iter(box.take, None)] == [b"busy5", b"d2"]


def test_the_outbox_stays_bounded_under_a_flood() -> None:
    box = Outbox(limit=100)
    for i in range(100_000):
        box.put("detections", i.to_bytes(4, "big"), "cam0")
    assert box.counts()["detections"] == 99_900
    held = _drain(box)
    assert len(held) == 100 and held[0] == ("detections", (99_900).to_bytes(4, "big"))


def test_the_newest_status_of_each_camera_waits() -> None:
    box = Outbox(limit=10)
    box.put("status", b"top-1", "top")
    box.put("status", b"side-1", "side")
    box.put("status", b"top-2", "top")  # supersedes top-1 only
    assert box.counts()["status"] == 1
    got = [(item.camera_id, item.payload) for item in iter(box.take, None)]
    assert got == [("side", b"side-1"), ("top", b"top-2")]


class Chunks:
    """The socket under `PacketCap`, handing out the broker's bytes in the chunks given, then end of stream."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    def recv(self, bufsize: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


def _packet(first: int, body: bytes) -> bytes:
    length, n = b"", len(body)
    while True:
        length += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return bytes([first]) + length + body


def _publish(topic: str, payload: bytes, qos: int = 0, mid: int = 7) -> bytes:
    packet_id = mid.to_bytes(2, "big") if qos else b""
    return _packet(0x30 | qos << 1, len(topic).to_bytes(2, "big") + topic.encode() + packet_id + payload)


def _read(cap: PacketCap) -> bytes:
    out = b""
    while chunk := cap.recv(3):  # as paho reads: a few bytes at a time
        out += chunk
    return out


def test_the_packet_cap_cuts_a_payload_over_the_limit_as_it_streams_by_and_passes_the_rest() -> None:
    small, long_topic = _publish("a/cam0/trigger", b"{}", qos=1), _publish("t" * 2000, b"x" * 100)
    big = _publish("a/cam0/trigger", b"x" * 8000, qos=2, mid=513)
    stream = small + big + long_topic + _packet(0x90, b"\x00\x01\x01")  # and a SUBACK
    cuts: list[tuple[str, int]] = []
    one_byte_at_a_time = [stream[i : i + 1] for i in range(len(stream))]
    for chunks in ([stream], one_byte_at_a_time, [stream[:40], stream[40:5000], stream[5000:]]):
        cap = PacketCap(Chunks(*chunks), 1024, lambda topic, size: cuts.append((topic, size)))
        cut = _packet(0x34, b"\x00\x01+\x02\x01")  # QoS 2 and packet id 513 kept, topic "+", no payload
        assert _read(cap) == small + cut + long_topic + _packet(0x90, b"\x00\x01\x01")
        assert cuts.pop() == ("a/cam0/trigger", 8000) and not cuts


def test_the_packet_cap_loses_the_connection_on_a_packet_only_a_broken_broker_sends() -> None:
    for stream in (_packet(0x90, b"\x00" * 5000), b"\x30\xff\xff\xff\xff\x01"):
        with pytest.raises(ConnectionError):
            _read(PacketCap(Chunks(stream), 1024, lambda topic, size: None))
