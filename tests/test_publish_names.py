"""``publish.endpoints`` and ``trigger.endpoint`` as an IPv6 address or a host name, and the clients
(``edged subscribe``, ``edged trigger``) that connect to them: the real daemon, the real commands, and
for names a real resolver (`dns`: a DNS server of the test's own, read through a mount namespace's
/etc/resolv.conf and /etc/hosts)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from daemon import edged_command, free_port, run_cli, write_config
from dns_server import TIMES_OUT, Answer, DnsServer, ResolvedDaemon, Resolver
from onnx_models import colour_probe
from waiting import wait_for

pytestmark = pytest.mark.integration


def config(tmp_path: Path, endpoint: str, **sections: dict[str, Any]) -> Path:
    """A daemon on a 10 fps folder of one red image publishing on ``endpoint``, ``sections`` added."""
    tmp_path.mkdir(exist_ok=True)
    colour_probe(tmp_path / "probe.onnx")
    (tmp_path / "frames").mkdir(exist_ok=True)
    cv2.imwrite(str(tmp_path / "frames" / "0.png"), np.full((48, 64, 3), (0, 0, 255), np.uint8))
    doc: dict[str, dict[str, Any]] = {
        "source": {"type": "images", "path": "frames", "fps": 10},
        "model": {"path": "probe.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.25},
        "thermal": {"enabled": False},
        "journal": {"enabled": False},
    }
    for name, keys in sections.items():
        doc.setdefault(name, {}).update(keys)
    return write_config(tmp_path / "edged.toml", doc)


class Daemon:
    """``edged run`` (in ``resolver``'s namespace when given); killed at the end."""

    def __init__(self, config: Path, resolver: Resolver | None = None) -> None:
        self.log_path = config.with_suffix(".log")
        argv = edged_command("run", "--config", str(config))
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(resolver.command(argv) if resolver else argv, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(15)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def command(resolver: Resolver | None, *args: str, timeout: float = 40) -> subprocess.CompletedProcess[str]:
    argv = edged_command(*args)
    return subprocess.run(resolver.command(argv) if resolver else argv, capture_output=True, text=True, timeout=timeout)


def test_an_ipv6_address_is_checked_served_and_subscribed_to(tmp_path: Path) -> None:
    endpoint = f"tcp://[::1]:{free_port()}"
    path = config(tmp_path, endpoint)
    checked = run_cli("check", "--config", str(path))
    assert checked.returncode == 0, checked.stderr
    assert f"publish.endpoints: {endpoint} (bound and released)" in checked.stdout
    daemon = Daemon(path)
    try:
        got = command(None, "subscribe", endpoint, "--json", "--count", "2", "--timeout", "30")
        assert got.returncode == 0, got.stderr + daemon.log()
        assert [json.loads(line)["kind"] for line in got.stdout.splitlines()]
        assert f"publishing on {endpoint}" in daemon.log()
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.close()


def test_a_name_with_only_an_ipv6_address_is_bound_and_reached(tmp_path: Path, dns: DnsServer) -> None:
    # An IPv6-only segment: the board's name has an AAAA record and no A record. (Not /etc/hosts: glibc
    # answers an IPv4 lookup of a name it gives ::1 there with 127.0.0.1.)
    dns.answer("edge6.test", Answer(["::1"]))
    resolver = Resolver(tmp_path, dns)
    endpoint, trigger = f"tcp://edge6.test:{free_port()}", f"tcp://edge6.test:{free_port()}"
    path = config(tmp_path, endpoint, trigger={"mode": "request", "endpoint": trigger})
    checked = command(resolver, "check", "--config", str(path))
    assert checked.returncode == 0, checked.stderr
    daemon = Daemon(path, resolver)
    try:
        got = command(resolver, "subscribe", endpoint, "--json", "--count", "1", "--timeout", "30")
        assert got.returncode == 0, got.stderr + daemon.log()
        port = endpoint.rpartition(":")[2]
        assert f"publishing on tcp://[::1]:{port} ({endpoint} as configured)" in daemon.log()
        verdict = command(resolver, "trigger", trigger, "--part-id", "P-1", "--json", "--timeout", "20")
        assert verdict.returncode in (0, 3), verdict.stderr + daemon.log()
        assert json.loads(verdict.stdout)["part_id"] == "P-1"
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.close()


def test_a_name_dns_does_not_know_today_is_exit_1_naming_it_never_78(tmp_path: Path, dns: DnsServer) -> None:
    # Exit 78 is the configuration's, which systemd does not restart: a name DNS cannot answer at boot
    # would keep the line down after DNS came back. Exit 1 is restarted, and the name looked up again.
    resolver = Resolver(tmp_path, dns)
    gone = f"tcp://edge-gone.test:{free_port()}"
    loopback = f"tcp://127.0.0.1:{free_port()}"
    cases = {  # judged as unencrypted on the network or not, the same; and the request endpoint's name
        "publish.endpoints": config(tmp_path / "plain", gone),
        "publish.endpoints ": config(tmp_path / "insecure", gone, publish={"insecure": True}),
        "trigger.endpoint": config(tmp_path / "trigger", loopback, trigger={"mode": "request", "endpoint": gone}),
    }
    for key, path in cases.items():
        checked = command(resolver, "check", "--config", str(path))
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert "configuration error" not in checked.stderr and f"{key.strip()}: cannot bind {gone}" in checked.stderr
        said = checked.stderr
        assert "edge-gone.test resolves to no address" in said or "edge-gone.test is not an interface" in said
        if key.endswith(" "):
            continue  # run binds as check does: once for each key is enough
        daemon = Daemon(path, resolver)
        try:
            assert daemon.proc.wait(30) == 1, daemon.log()
            assert f"cannot bind {gone}" in daemon.log() and "edge-gone.test" in daemon.log()
        finally:
            daemon.close()


def test_a_reload_while_dns_does_not_answer_holds_up_no_frame_and_is_taken(tmp_path: Path, dns: DnsServer) -> None:
    # The board's name resolved at start; DNS then stops answering and the operator reloads. The reload
    # looks the name up again off the loop (frames go on) and is taken: the endpoint stays bound as it
    # is, and a name DNS cannot answer now is no reason to refuse the configuration.
    dns.answer("edge.test", Answer(["127.0.0.1"]))
    resolver = Resolver(tmp_path, dns, timeout_s=3)
    port = free_port()
    path = config(tmp_path, f"tcp://edge.test:{port}")
    d = ResolvedDaemon(path, f"tcp://127.0.0.1:{port}", resolver)
    try:
        d.wait_status(lambda s: s.frames_processed > 0, timeout=30)
        dns.answer("edge.test", TIMES_OUT)
        path.write_text(path.read_text().replace("[model]\n", "[model]\nconf = 0.3\n"))
        asked = dns.asked("edge.test")
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: dns.asked("edge.test") > asked, 10), d.log()  # the load waits on DNS now
        since = time.time_ns()
        assert len(d.captured_after(since, 5, timeout=5)) == 5, d.log()
        assert wait_for(lambda: "reloaded" in d.log(), 30), d.log()
        assert "reload refused" not in d.log()
        assert d.stop(timeout=10) == 0, d.log()
    finally:
        d.close()


def test_edged_trigger_reaches_a_name_with_both_addresses_where_edged_listens(tmp_path: Path, dns: DnsServer) -> None:
    # The resolver gives ::1 first for a name with both (as for localhost); edged binds a name's IPv4 address.
    dns.answer("line3.test", Answer(["127.0.0.1", "::1"]))
    resolver = Resolver(tmp_path, dns)
    trigger = f"tcp://line3.test:{free_port()}"
    path = config(tmp_path, f"tcp://127.0.0.1:{free_port()}", trigger={"mode": "request", "endpoint": trigger})
    daemon = Daemon(path, resolver)
    try:
        assert wait_for(lambda: "taking inspection requests" in daemon.log(), 30), daemon.log()
        verdict = command(resolver, "trigger", trigger, "--part-id", "P-2", "--json", "--timeout", "20")
        assert verdict.returncode in (0, 3), verdict.stderr + daemon.log()
        assert json.loads(verdict.stdout)["part_id"] == "P-2"
    finally:
        daemon.close()


def test_edged_trigger_ends_by_its_timeout_while_dns_does_not_answer(tmp_path: Path, dns: DnsServer) -> None:
    dns.answer("plc-gw.test", TIMES_OUT)
    resolver = Resolver(tmp_path, dns, timeout_s=5)  # each lookup waits 5 s for the server
    started = time.monotonic()
    result = command(resolver, "trigger", f"tcp://plc-gw.test:{free_port()}", "--timeout", "1")
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert "no answer from the resolver for plc-gw.test within 1 s" in result.stderr
    assert took < 4.5, f"edged trigger --timeout 1 took {took:.1f} s"


def test_edged_subscribe_says_a_name_does_not_resolve_and_follows_it_once_it_does(tmp_path: Path, dns: DnsServer) -> None:
    resolver = Resolver(tmp_path, dns)
    port = free_port()
    daemon = Daemon(config(tmp_path, f"tcp://127.0.0.1:{port}"))
    argv = resolver.command(edged_command("subscribe", f"tcp://late.test:{port}", "--json", "--count", "1"))
    sub = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(sub.stderr or []), daemon=True)
    reader.start()
    try:
        assert wait_for(lambda: any("still trying" in line for line in said), 20), said
        assert "late.test does not resolve now" in said[0]
        dns.answer("late.test", Answer(["127.0.0.1"]))  # DNS comes back: libzmq looks the name up again as it retries
        assert sub.wait(30) == 0, "".join(said) + daemon.log()
        assert json.loads((sub.stdout.read() if sub.stdout else "").splitlines()[0])["kind"]
    finally:
        if sub.poll() is None:
            sub.kill()
        sub.communicate()
        daemon.close()


def test_edged_subscribe_stops_on_ctrl_c_while_dns_does_not_answer(tmp_path: Path, dns: DnsServer) -> None:
    dns.answer("dead.test", TIMES_OUT)
    resolver = Resolver(tmp_path, dns, timeout_s=10)
    sub = subprocess.Popen(
        resolver.command(edged_command("subscribe", f"tcp://dead.test:{free_port()}")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for(lambda: dns.asked("dead.test") > 0, 20)
        started = time.monotonic()
        sub.send_signal(signal.SIGINT)
        _, err = sub.communicate(timeout=20)
        assert time.monotonic() - started < 3, "Ctrl-C waited for the resolver"
        assert sub.returncode in (0, 130), err  # 130: interrupted before it was connected
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.communicate()
