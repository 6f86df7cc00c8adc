"""The stream's security over real sockets: CURVE on tcp, an allow-list of subscribers, safe key files."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from daemon import RunningDaemon, free_port, run_cli, write_config, write_video
from onnx_models import LABELS, colour_probe
from waiting import wait_for
from zmq.auth.thread import AuthenticationThread

from edged import publish
from edged.cli import main
from edged.config import PublishConfig, load_config
from edged.errors import ConfigError, KeyFileError, PublishError
from edged.keys import ClientKeys, create_key_pair, key_file_problems, load_secret_key
from edged.messages import DetectionsMessage, ModelInfo, StatusMessage
from edged.publish import Publisher, status_topic
from edged.subscribe import Subscriber

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Keys:
    server_public: Path
    server_secret: Path
    clients_dir: Path
    client_secret: Path
    client: ClientKeys  # its public key is in the allow-list
    outsider_public: Path
    outsider: ClientKeys  # a valid pair that is not


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    """Made the way an operator would: keygen for each party, client public keys copied over."""
    server_public, server_secret = create_key_pair(tmp_path / "server", "server")
    client_public, client_secret = create_key_pair(tmp_path / "line3", "line3")
    clients = tmp_path / "clients"
    clients.mkdir()
    shutil.copy(client_public, clients)
    outsider_public, outsider_secret = create_key_pair(tmp_path / "elsewhere", "outsider")
    return Keys(
        server_public,
        server_secret,
        clients,
        client_secret,
        ClientKeys.from_files(server_public, client_secret),
        outsider_public,
        ClientKeys.from_files(server_public, outsider_secret),
    )


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


MakePublisher = Callable[[PublishConfig], Publisher]
MakeSubscriber = Callable[..., Subscriber]


@pytest.fixture
def publisher(context: zmq.Context) -> Iterator[MakePublisher]:
    """Makes publishers on the test's context and closes every one at teardown, failed test or not."""
    made: list[Publisher] = []

    def make(cfg: PublishConfig) -> Publisher:
        made.append(Publisher(cfg, ["cam0"], context))
        return made[-1]

    yield make
    for pub in made:
        pub.close()


@pytest.fixture
def subscriber(context: zmq.Context) -> Iterator[MakeSubscriber]:
    """Makes `Subscriber`s (endpoint, topic, curve=...) on the test's context; all closed at teardown."""
    made: list[Subscriber] = []

    def make(endpoint: str, topic: str = "", *, curve: ClientKeys | None = None) -> Subscriber:
        made.append(Subscriber(endpoint, topic, context=context, curve=curve))
        return made[-1]

    yield make
    for sub in made:
        sub.close()


def _curve_config(keys: Keys, endpoints: list[str] | None = None, **cfg: object) -> PublishConfig:
    return PublishConfig(
        endpoints=endpoints or ["tcp://127.0.0.1:*"],
        curve_server_key=keys.server_secret,
        curve_clients_dir=keys.clients_dir,
        **cfg,
    )  # type: ignore[arg-type]


def _status(seq: int) -> bytes:
    return (
        StatusMessage(
            camera_id="cam0",
            seq=seq,
            time_ns=0,
            uptime_s=0.0,
            fps=0.0,
            frames_processed=0,
            source_state="ok",
            drops={},
            latency={},
            rate_cap_fps=None,
            thermal=None,
            model=ModelInfo(name="probe", sha256="0" * 64, provider="CPUExecutionProvider"),
        )
        .model_dump_json()
        .encode()
    )


def _join(pub: Publisher, *subs: Subscriber, timeout_s: float = 5) -> int:
    """PUB/SUB joins asynchronously: send until every one has a message, drain, return the next seq."""
    seq, pending, deadline = 0, set(subs), time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        pub.send(status_topic("edged", "cam0"), _status(seq))
        seq += 1
        pending = {sub for sub in pending if sub.receive(0.02) is None}
    if pending:
        raise AssertionError(f"never joined: {[sub.stats.handshake_error for sub in pending]}")
    for sub in subs:
        while sub.receive(0.05) is not None:
            pass
    return seq


def test_only_an_allowed_key_gets_the_stream(publisher: MakePublisher, subscriber: MakeSubscriber, keys: Keys) -> None:
    pub = publisher(_curve_config(keys, hwm=1000))  # no drops at the HWM: every message must arrive
    endpoint = pub.endpoints[0]
    wrong_server = ClientKeys(keys.client.public, keys.client.public, keys.client.secret)
    intruders = {
        "key not in the allow-list": (keys.outsider, "refused this subscriber's key"),
        "wrong server key": (wrong_server, "is --server-key the publisher's public key"),
        "plaintext": (None, "CURVE is configured on one side only"),
    }
    allowed = subscriber(endpoint, curve=keys.client)
    others = {name: subscriber(endpoint, curve=curve) for name, (curve, _) in intruders.items()}
    seq = _join(pub, allowed)
    for i in range(seq, seq + 50):
        assert pub.send(status_topic("edged", "cam0"), _status(i))
    got = [allowed.receive(2.0) for _ in range(50)]
    assert [m.seq for m in got if m is not None] == list(range(seq, seq + 50))
    assert allowed.stats.lost == 0 and allowed.stats.handshake_failures == 0
    for name, sub in others.items():
        assert sub.receive(0.2) is None, name
        assert sub.stats.received.total() == 0, name
        assert intruders[name][1] in (sub.stats.handshake_error or ""), (name, sub.stats.handshake_error)


def test_ipc_stays_plain_beside_a_curve_tcp_endpoint(
    publisher: MakePublisher, subscriber: MakeSubscriber, keys: Keys, tmp_path: Path
) -> None:
    ipc = f"ipc://{tmp_path}/det.sock"
    pub = publisher(_curve_config(keys, [ipc, "tcp://127.0.0.1:*"]))
    assert pub.endpoints[0] == ipc and pub.endpoints[1].startswith("tcp://127.0.0.1:")
    local = subscriber(ipc)  # no keys: the file permissions are the protection
    remote = subscriber(pub.endpoints[1], curve=keys.client)
    plaintext_tcp = subscriber(pub.endpoints[1])
    seq = _join(pub, local, remote)
    assert pub.send(status_topic("edged", "cam0"), _status(seq))
    for sub in (local, remote):
        msg = sub.receive(2.0)
        assert msg is not None and msg.seq == seq
    assert plaintext_tcp.receive(0.2) is None and plaintext_tcp.stats.handshake_failures >= 1
    assert pub.sent == seq + 1 and not pub.drops


def test_keys_allow_tcp_beyond_loopback(publisher: MakePublisher, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publish, "exposure", lambda endpoint: True)  # as if 127.0.0.1 were the LAN
    with pytest.raises(PublishError, match="unencrypted"):
        publisher(PublishConfig(endpoints=["tcp://127.0.0.1:*"]))
    assert publisher(_curve_config(keys)).endpoints[0].startswith("tcp://127.0.0.1:")


def test_close_stops_the_authenticator_and_leaves_no_socket_open(keys: Keys) -> None:
    def auth_threads() -> int:
        return sum(isinstance(t, AuthenticationThread) for t in threading.enumerate())

    before, context = auth_threads(), zmq.Context()
    ipc = f"ipc://{keys.clients_dir.parent / 'det.sock'}"
    pub = Publisher(_curve_config(keys, [ipc, "tcp://127.0.0.1:*"]), ["cam0"], context)
    assert auth_threads() == before + 1
    pub.close()
    assert auth_threads() == before
    term = threading.Thread(target=context.term, daemon=True)  # term() waits for every open socket
    term.start()
    term.join(5)
    assert not term.is_alive(), "a socket was left open"


def test_a_key_added_to_the_allow_list_is_admitted_after_reload(
    publisher: MakePublisher, subscriber: MakeSubscriber, keys: Keys
) -> None:
    pub = publisher(_curve_config(keys, hwm=1000))
    connected = subscriber(pub.endpoints[0], curve=keys.client)
    _join(pub, connected)
    with pytest.raises(AssertionError, match="refused this subscriber's key"):
        _join(pub, subscriber(pub.endpoints[0], curve=keys.outsider), timeout_s=0.5)
    keys.outsider_public.rename(keys.clients_dir / keys.outsider_public.name)
    assert pub.reload_client_keys() == 2
    seq = _join(pub, subscriber(pub.endpoints[0], curve=keys.outsider))  # its seq from 0 again: not a gap
    # Nobody lost a key: the socket was not bound afresh, so the connected subscriber missed nothing.
    for i in range(seq, seq + 20):
        assert pub.send(status_topic("edged", "cam0"), _status(i))
    while connected.receive(0.5) is not None:
        pass
    assert connected.stats.lost == 0 and connected.stats.handshake_failures == 0


@pytest.mark.parametrize(("mode", "who"), [(0o700, None), (0o770, "its group"), (0o777, "everyone")])
def test_an_allow_list_others_may_write_to_is_said_at_each_load(
    publisher: MakePublisher, keys: Keys, caplog: pytest.LogCaptureFixture, mode: int, who: str | None
) -> None:
    """Whoever can put a key in the folder lets a subscriber in at the next reload: it was said nowhere."""
    keys.clients_dir.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="edged.publish"):
        pub = publisher(_curve_config(keys))
        pub.reload_client_keys()
    said = [r.getMessage() for r in caplog.records if "may be written by" in r.getMessage()]
    assert said == (
        []
        if who is None
        else [
            f"publish.curve_clients_dir {keys.clients_dir} may be written by {who}: "
            f"whoever can put a key there lets a subscriber in at the next reload "
            f"(chmod go-w {keys.clients_dir})"
        ]
        * 2
    )


def test_a_revoked_key_is_cut_off_at_reload_and_the_others_reconnect(
    publisher: MakePublisher, subscriber: MakeSubscriber, keys: Keys
) -> None:
    shutil.copy(keys.outsider_public, keys.clients_dir)
    pub = publisher(_curve_config(keys, hwm=1000))
    endpoint = pub.endpoints[0]
    kept, revoked = subscriber(endpoint, curve=keys.client), subscriber(endpoint, curve=keys.outsider)
    seq = _join(pub, kept, revoked)
    before = revoked.stats.received.total()
    (keys.clients_dir / keys.outsider_public.name).unlink()
    assert pub.reload_client_keys() == 1
    assert pub.endpoints[0] == endpoint  # the same port, bound afresh
    reconnected = None
    deadline = time.monotonic() + 10
    while reconnected is None and time.monotonic() < deadline:  # the kept one reconnects by itself
        pub.send(status_topic("edged", "cam0"), _status(seq))
        seq += 1
        reconnected = kept.receive(0.02)
    assert reconnected is not None, kept.stats.handshake_error
    assert kept.stats.lost >= 1, "the messages sent while it reconnected are a gap in seq"
    for i in range(seq, seq + 20):
        assert pub.send(status_topic("edged", "cam0"), _status(i))
    assert [m.seq for m in iter(lambda: kept.receive(2.0), None)][-1] == seq + 19
    assert revoked.receive(0.5) is None and revoked.stats.received.total() == before
    assert "refused this subscriber's key" in (revoked.stats.handshake_error or "")


def _write_secret(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


def _mismatched_pair(k: Keys) -> None:
    secret = load_secret_key(k.server_secret, "test")[1].decode()
    _write_secret(k.server_secret, f'public-key = "{k.outsider.public.decode()}"\nsecret-key = "{secret}"\n')


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        pytest.param(
            lambda k: k.server_secret.unlink(), "publish.curve_server_key: .*server.key_secret does not exist", id="missing"
        ),
        pytest.param(
            lambda k: k.server_secret.chmod(0o644),
            r"publish.curve_server_key: permissions 0644 .* too open; .*\(chmod 600 ",
            id="world-readable",
        ),
        pytest.param(lambda k: k.server_secret.chmod(0o640), "permissions 0640 .* too open", id="group-readable"),
        pytest.param(lambda k: k.server_secret.chmod(0o620), "permissions 0620 .* too open", id="group-writable"),
        pytest.param(lambda k: _write_secret(k.server_secret, "hello\n"), "is not a zmq certificate", id="garbage"),
        pytest.param(
            lambda k: _write_secret(k.server_secret, k.server_public.read_text()),
            "has no secret key; pass the .key_secret",
            id="public-instead",
        ),
        pytest.param(
            lambda k: _write_secret(k.server_secret, 'public-key = "short"\nsecret-key = "short"\n'),
            "malformed key",
            id="malformed",
        ),
        pytest.param(_mismatched_pair, "do not belong together", id="mismatched"),
        pytest.param(
            lambda k: k.server_secret.unlink() or k.server_secret.mkdir(mode=0o700), "is not a regular file", id="directory"
        ),
        pytest.param(
            lambda k: shutil.rmtree(k.clients_dir),
            "publish.curve_clients_dir: .*clients does not exist or is not a directory",
            id="no-clients-dir",
        ),
        pytest.param(
            lambda k: (k.clients_dir / "bad.key").write_text("no key here\n"),
            "publish.curve_clients_dir: .*bad.key is not a zmq certificate",
            id="bad-client-key",
        ),
    ],
)
def test_an_unusable_key_file_is_a_clear_config_error(
    publisher: MakePublisher, keys: Keys, setup: Callable[[Keys], object], message: str
) -> None:
    setup(keys)
    with pytest.raises(KeyFileError, match=message) as raised:
        publisher(_curve_config(keys))
    assert key_file_problems(keys.server_secret, keys.clients_dir) == [str(raised.value)]


def test_keys_must_be_configured_together(tmp_path: Path, keys: Keys) -> None:
    colour_probe(tmp_path / "probe.onnx")
    config = write_config(
        tmp_path / "edged.toml", {"model": {"path": "probe.onnx"}, "publish": {"curve_server_key": str(keys.server_secret)}}
    )
    with pytest.raises(ConfigError) as raised:
        load_config(config)
    assert raised.value.problems == [
        "publish.curve_clients_dir: Value error, set both publish.curve_server_key and "
        "publish.curve_clients_dir, or neither; got None"
    ]


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_keygen_writes_a_usable_pair_with_safe_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str], umask: int) -> None:
    old = os.umask(umask)
    try:
        assert main(["keygen", str(tmp_path / "keys")]) == 0
    finally:
        os.umask(old)
    public, secret = tmp_path / "keys" / "server.key", tmp_path / "keys" / "server.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    out = capsys.readouterr().out
    assert f'curve_server_key = "{secret}"' in out and f"--server-key {public}" in out
    pair = load_secret_key(secret, "test")
    assert zmq.auth.load_certificate(public) == (pair[0], None)
    before = secret.read_bytes()
    assert main(["keygen", str(tmp_path / "keys")]) == 1  # never replaces a pair clients depend on
    assert "already exists" in capsys.readouterr().err and secret.read_bytes() == before


def test_keygen_for_a_subscriber_says_where_the_public_key_goes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keygen", str(tmp_path), "--name", "line3"]) == 0
    out = capsys.readouterr().out
    assert f"Copy {tmp_path / 'line3.key'} into the publisher's publish.curve_clients_dir" in out
    assert main(["keygen", str(tmp_path), "--name", "../escape"]) == 1
    assert "may only hold letters" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["line3.key", "line3.key_secret"]


def test_subscribe_refuses_half_or_unsafe_client_keys(
    tmp_path: Path, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["subscribe", "tcp://127.0.0.1:1", "--timeout", "0.1"]
    assert main([*base, "--server-key", str(keys.server_public)]) == 2
    assert "go together" in capsys.readouterr().err
    _, secret = create_key_pair(tmp_path / "me", "me")
    secret.chmod(0o644)
    assert main([*base, "--server-key", str(keys.server_public), "--client-key", str(secret)]) == 78
    assert "--client-key: permissions 0644" in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_the_ipc_directory_is_created_0750(
    publisher: MakePublisher, tmp_path: Path, umask: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "run" / "edged"
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(runtime))
    old = os.umask(umask)
    try:
        publisher(PublishConfig(endpoints=[f"ipc://{runtime}/det.sock"]))
    finally:
        os.umask(old)
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o750
    assert stat.S_IMODE((runtime / "det.sock").stat().st_mode) == 0o660


def test_an_ipc_directory_is_made_only_under_the_runtime_directory(
    publisher: MakePublisher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "run"
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(runtime))
    for folder in (tmp_path / "nonexistent" / "dir", runtime / ".." / "elsewhere"):
        with pytest.raises(PublishError, match=re.escape(f"cannot bind ipc://{folder}/det.sock: No such file or directory")):
            publisher(PublishConfig(endpoints=[f"ipc://{folder}/det.sock"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert publisher(PublishConfig(endpoints=[f"ipc://{runtime}/line3/det.sock"])).endpoints
    assert stat.S_IMODE((runtime / "line3").stat().st_mode) == 0o750


def test_an_existing_ipc_directory_keeps_its_mode(publisher: MakePublisher, tmp_path: Path) -> None:
    runtime = tmp_path / "edged"
    runtime.mkdir(mode=0o700)  # e.g. made by systemd's RuntimeDirectory= with its own mode
    runtime.chmod(0o710)
    publisher(PublishConfig(endpoints=[f"ipc://{runtime}/det.sock"]))
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o710


# ---- the real daemon -----------------------------------------------------------------------


def _daemon_config(tmp_path: Path, keys: Keys, endpoint: str) -> Path:
    colour_probe(tmp_path / "probe.onnx")
    write_video(tmp_path / "clip.avi", [(0, 0, 255), (255, 0, 0)] * 20)
    return write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
            "model": {"path": "probe.onnx"},
            "publish": {
                "endpoints": [endpoint],
                "status_interval_s": 0.5,
                "curve_server_key": str(keys.server_secret),
                "curve_clients_dir": str(keys.clients_dir),
            },
            "thermal": {"enabled": False},
        },
    )


def test_the_daemon_streams_to_allowed_keys_only(tmp_path: Path, keys: Keys, subscriber: MakeSubscriber) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = RunningDaemon(_daemon_config(tmp_path, keys, endpoint), endpoint)  # its own SUB is plaintext
    try:
        sub = subscriber(endpoint, "edged/detections/", curve=keys.client)
        got = [sub.receive(20.0) for _ in range(4)]
        assert all(isinstance(m, DetectionsMessage) for m in got), (got, daemon.log())
        for msg in got:
            assert isinstance(msg, DetectionsMessage)
            assert msg.detections[0].label == LABELS[(msg.frame_id % 40) % 2]
        cli = run_cli(
            "subscribe",
            endpoint,
            "--json",
            "--count",
            "2",
            "--timeout",
            "20",
            "--topic",
            "edged/status/",
            "--server-key",
            str(keys.server_public),
            "--client-key",
            str(keys.client_secret),
        )
        assert cli.returncode == 0, cli.stderr
        statuses = [StatusMessage.model_validate_json(line) for line in cli.stdout.splitlines()]
        assert len(statuses) == 2 and all(m.kind == "status" for m in statuses)
        assert not daemon.sub.poll(200), "a plaintext subscriber received from the CURVE socket"
        assert daemon.stop() == 0
    finally:
        daemon.close()


def test_the_daemon_refuses_a_world_readable_server_key(tmp_path: Path, keys: Keys) -> None:
    keys.server_secret.chmod(0o644)
    config = _daemon_config(tmp_path, keys, f"tcp://127.0.0.1:{free_port()}")
    for command in ("run", "check"):
        result = run_cli(command, "--config", str(config), timeout=30)
        assert result.returncode == 78, (command, result.stderr)
        assert "publish.curve_server_key: permissions 0644" in result.stderr, command
        assert "chmod 600" in result.stderr, command


def test_the_daemon_cuts_off_a_revoked_key_on_sighup(tmp_path: Path, keys: Keys, subscriber: MakeSubscriber) -> None:
    shutil.copy(keys.outsider_public, keys.clients_dir)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = RunningDaemon(_daemon_config(tmp_path, keys, endpoint), endpoint)
    try:
        kept = subscriber(endpoint, "edged/detections/", curve=keys.client)
        revoked = subscriber(endpoint, "edged/detections/", curve=keys.outsider)
        for sub in (kept, revoked):
            assert isinstance(sub.receive(20.0), DetectionsMessage), daemon.log()
        (keys.clients_dir / keys.outsider_public.name).unlink()
        daemon.signal(signal.SIGHUP)
        assert wait_for(lambda: "1 subscriber key(s) revoked" in daemon.log(), 20), daemon.log()
        last_seen = max((m.seq for m in _drain(revoked, quiet_s=2.0, at_most_s=10.0)), default=-1)
        assert "refused this subscriber's key" in (revoked.stats.handshake_error or "")
        resumed = None  # the kept key reconnects by itself and the stream goes on well past that
        deadline = time.monotonic() + 20
        while (resumed is None or resumed.seq <= last_seen + 20) and time.monotonic() < deadline:
            resumed = kept.receive(1.0) or resumed
        assert resumed is not None and resumed.seq > last_seen + 20, daemon.log()
        assert revoked.receive(2.0) is None
        assert daemon.stop() == 0
    finally:
        daemon.close()


def _drain(sub: Subscriber, quiet_s: float, at_most_s: float) -> list[DetectionsMessage | StatusMessage]:
    """What ``sub`` has or still gets, until ``quiet_s`` pass without a message."""
    got, deadline = [], time.monotonic() + at_most_s
    while time.monotonic() < deadline and (msg := sub.receive(quiet_s)) is not None:
        got.append(msg)
    return got
