"""An RTSP camera named by a host name DNS does not know, or whose DNS server does not answer, and by
an IPv6 address: ``edged check`` and ``edged run`` through a real resolver (`dns`: a DNS server of
the test's own, read through a mount namespace's /etc/resolv.conf), READY=1 read as systemd reads it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from daemon import edged_command, free_port, run_cli, write_config
from dns_server import TIMES_OUT, DnsServer, Resolver
from onnx_models import colour_probe

pytestmark = pytest.mark.integration


def config(tmp_path: Path, url: str) -> Path:
    colour_probe(tmp_path / "probe.onnx")
    return write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "rtsp", "url": url, "open_timeout_s": 1.0},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [f"tcp://127.0.0.1:{free_port()}"]},
            "thermal": {"enabled": False},
            "journal": {"enabled": False},
        },
    )


def test_a_camera_name_dns_does_not_know_is_said_as_such(tmp_path: Path, dns: DnsServer) -> None:
    resolver = Resolver(tmp_path, dns)
    path = config(tmp_path, "rtsp://admin:secret@cam-gone.test:8554/stream")
    checked = subprocess.run(
        resolver.command(edged_command("check", "--config", str(path))), capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 1, checked.stderr  # a camera that cannot be used now, not the configuration
    assert "cam-gone.test does not resolve now" in checked.stderr and "source.url" in checked.stderr
    assert "secret" not in checked.stdout + checked.stderr


def test_an_ipv6_camera_address_is_written_in_brackets(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET6) as closed:  # a port of ::1 nobody listens on
        closed.bind(("::1", 0))
        port = closed.getsockname()[1]
    checked = run_cli("check", "--config", str(config(tmp_path, f"rtsp://[::1]:{port}/stream")))
    assert checked.returncode == 1
    assert f"connection to [::1]:{port} refused" in checked.stderr, checked.stderr


def test_a_dns_server_that_never_answers_holds_up_neither_ready_nor_stop(tmp_path: Path, dns: DnsServer) -> None:
    # open_timeout_s bounds the wait for a camera, its name's lookup included: READY=1 (the camera
    # known to be lost) and a check come within it, not after the resolver's 30 s.
    dns.answer("cam-slow.test", TIMES_OUT)
    resolver = Resolver(tmp_path, dns, timeout_s=30)
    path = config(tmp_path, "rtsp://cam-slow.test:8554/stream")
    started = time.monotonic()
    checked = subprocess.run(
        resolver.command(edged_command("check", "--config", str(path))), capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 1 and time.monotonic() - started < 10, checked.stderr
    assert "no answer from the resolver for cam-slow.test within 1 s" in checked.stderr, checked.stderr
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(15)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    env.pop("WATCHDOG_USEC", None)
    with (tmp_path / "run.log").open("w") as log:
        started = time.monotonic()
        proc = subprocess.Popen(
            resolver.command(edged_command("run", "--config", str(path))), stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        said = ""
        while "READY=1" not in said.splitlines():
            said = notify.recv(4096).decode()  # TimeoutError after 15 s: no READY
        assert time.monotonic() - started < 12, (tmp_path / "run.log").read_text()
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert time.monotonic() - stopping < 5, (tmp_path / "run.log").read_text()
        assert "no answer from the resolver for cam-slow.test" in (tmp_path / "run.log").read_text()
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
