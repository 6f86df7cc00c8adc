"""``[mqtt] url`` naming its broker by IPv6 address or by a host name that does not resolve, resolves
to ::1 alone, or whose DNS server does not answer: real Mosquitto, the real daemon, and a real resolver
(`dns`: a DNS server of the test's own, read through a mount namespace's /etc/resolv.conf)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon import RunningDaemon, edged_command, free_port, run_cli, write_config
from dns_server import TIMES_OUT, Answer, DnsServer, ResolvedDaemon, Resolver
from mosquitto import MOSQUITTO, Broker
from test_publish_names import config as publishing
from waiting import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path, free_port())
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def broker6(tmp_path: Path) -> Iterator[int]:
    """Mosquitto on ::1 alone: its port."""
    port = free_port()
    conf = tmp_path / "mosquitto6.conf"
    conf.write_text(f"listener {port} ::1\nallow_anonymous true\npersistence false\nuser root\n")
    with (tmp_path / "mosquitto6.log").open("wb") as log:
        proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)

    def accepting() -> bool:
        with socket.socket(socket.AF_INET6) as probe:
            return probe.connect_ex(("::1", port)) == 0

    try:
        assert wait_for(accepting, 20), (tmp_path / "mosquitto6.log").read_text()
        yield port
    finally:
        proc.kill()
        proc.wait()


def config(tmp_path: Path, url: str) -> tuple[Path, str]:
    """A daemon on a 10 fps image folder publishing to the broker at ``url``; the config and its ZeroMQ endpoint."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    return publishing(tmp_path, endpoint, mqtt={"url": url, "keepalive_s": 5}), endpoint


def test_a_broker_on_an_ipv6_address_is_checked_and_published_to(tmp_path: Path, broker6: int) -> None:
    url = f"mqtt://[::1]:{broker6}"
    path, endpoint = config(tmp_path, url)
    checked = run_cli("check", "--config", str(path))
    assert checked.returncode == 0, checked.stderr
    assert f"{url} accepted connection" in checked.stdout
    d = RunningDaemon(path, endpoint)
    try:
        d.wait_status(lambda s: s.mqtt_state == "connected", timeout=30)
        assert f"MQTT: connected to {url}" in d.log()
        assert d.stop() == 0
    finally:
        d.close()


def test_a_broker_name_with_only_an_ipv6_address_is_reached(tmp_path: Path, dns: DnsServer, broker6: int) -> None:
    dns.answer("broker6.test", Answer(["::1"]))  # an AAAA record and no A record: an IPv6-only segment
    resolver = Resolver(tmp_path, dns)
    path, endpoint = config(tmp_path, f"mqtt://broker6.test:{broker6}")
    checked = subprocess.run(
        resolver.command(edged_command("check", "--config", str(path))), capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stderr
    d = ResolvedDaemon(path, endpoint, resolver)
    try:
        d.wait_status(lambda s: s.mqtt_state == "connected", timeout=30)
    finally:
        d.close()


def test_a_broker_name_dns_does_not_know_today_is_retried_until_it_does(
    tmp_path: Path, dns: DnsServer, broker: Broker
) -> None:
    # Exit 78 would keep the service down after DNS came back (systemd does not restart it), and any
    # exit would stop the inspections with the broker: the daemon serves on and keeps asking.
    resolver = Resolver(tmp_path, dns)
    path, endpoint = config(tmp_path, f"mqtt://broker.test:{broker.port}")
    checked = subprocess.run(
        resolver.command(edged_command("check", "--config", str(path))), capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "mqtt: cannot resolve broker.test" in checked.stderr, checked.stderr
    d = ResolvedDaemon(path, endpoint, resolver)
    try:
        d.wait_status(lambda s: s.frames_processed > 3, timeout=30)
        assert wait_for(lambda: "MQTT: cannot resolve broker.test" in d.log(), 10), d.log()
        dns.answer("broker.test", Answer(["127.0.0.1"]))
        d.wait_status(lambda s: s.mqtt_state == "connected", timeout=30)
        assert d.proc.poll() is None
    finally:
        d.close()


def test_a_dns_server_that_never_answers_holds_up_no_frame_no_reload_and_no_stop(tmp_path: Path, dns: DnsServer) -> None:
    dns.answer("broker.test", TIMES_OUT)
    resolver = Resolver(tmp_path, dns, timeout_s=30)  # every lookup of the broker's name waits 30 s
    path, endpoint = config(tmp_path, "mqtt://broker.test")
    started = time.monotonic()
    d = ResolvedDaemon(path, endpoint, resolver)
    try:
        first = d.wait_status(lambda s: s.frames_processed > 0, timeout=20)
        assert time.monotonic() - started < 15 and first.mqtt_state == "disconnected"
        assert wait_for(lambda: dns.asked("broker.test") > 0, 10)  # the MQTT thread is in its lookup now
        since = time.time_ns()
        assert len(d.captured_after(since, 10, timeout=5)) == 10  # 10 fps go on
        write_config(path, {**_sections(path), "mqtt": {"url": "mqtt://broker.test:1884", "keepalive_s": 5}})
        d.signal(signal.SIGHUP)  # a reload replaces the MQTT output, whose thread is still in the lookup
        assert wait_for(lambda: "reloaded" in d.log(), 10), d.log()
        since = time.time_ns()
        assert len(d.captured_after(since, 5, timeout=5)) == 5
        stopping = time.monotonic()
        assert d.stop(timeout=10) == 0, d.log()
        assert time.monotonic() - stopping < 5, d.log()
    finally:
        d.close()


def _sections(path: Path) -> dict[str, dict[str, Any]]:
    import tomllib

    return dict(tomllib.loads(path.read_text()))


def test_an_ipv6_broker_address_without_brackets_is_refused_saying_how_to_write_it() -> None:
    from pydantic import ValidationError

    from edged.settings.mqtt import MqttConfig

    with pytest.raises(ValidationError, match=r"an IPv6 address goes in brackets: mqtt://\[::1\]:PORT"):
        MqttConfig(url="mqtt://::1:1883")
    assert (MqttConfig(url="mqtts://[::1]").host, MqttConfig(url="mqtts://[::1]").port) == ("::1", 8883)


def test_an_ipv6_broker_that_refuses_is_named_in_brackets(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET6) as closed:  # a port of ::1 nobody listens on
        closed.bind(("::1", 0))
        port = closed.getsockname()[1]
    path, _ = config(tmp_path, f"mqtt://[::1]:{port}")
    checked = run_cli("check", "--config", str(path))
    assert checked.returncode == 1, checked.stderr
    assert f"mqtt: [::1]:{port} refused the connection" in checked.stderr, checked.stderr
