"""``edged keygen``: the publisher's key layout, owned so that the service can read it, and the
docs/outputs.md's key setup followed word for word up to a subscriber getting the stream through CURVE."""

from __future__ import annotations

import ctypes
import grp
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon import RunningDaemon, edged_command, free_port, write_config, write_video
from onnx_models import colour_probe

from edged.cli import main
from edged.messages import DetectionsMessage

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parent.parent / "docs" / "outputs.md"
SERVICE = "nobody"  # a user every Debian system has, standing in for the package's "edged"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing files to another user takes root")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's own are 0700), so that another user can be tried."""
    path = Path(tempfile.mkdtemp(prefix="edged-keys-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _owner(path: Path) -> tuple[str, str]:
    st = path.stat()
    return pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name


def _as(user: str, *command: str) -> subprocess.CompletedProcess[bytes]:
    entry = pwd.getpwnam(user)
    return subprocess.run(command, user=entry.pw_uid, group=entry.pw_gid, extra_groups=[], capture_output=True, timeout=30)


def _readable_as(user: str, secret: Path, clients: Path) -> bool:
    """Whether ``user``, in its own group only, can read the secret key and list the allow-list: the kernel decides."""
    read, listed = _as(user, "cat", str(secret)), _as(user, "ls", str(clients))
    return read.returncode == 0 and read.stdout == secret.read_bytes() and listed.returncode == 0


@needs_root
def test_keygen_makes_the_layout_and_hands_the_secret_to_the_service_user(
    shared_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = shared_dir / "etc" / "edged" / "keys"
    old = os.umask(0o077)  # root's strictest umask must not lock the service out
    try:
        assert main(["keygen", str(keys), "--user", SERVICE]) == 0
    finally:
        os.umask(old)
    group = grp.getgrgid(pwd.getpwnam(SERVICE).pw_gid).gr_name
    secret, public, clients = keys / "server.key_secret", keys / "server.key", keys / "clients"
    assert (_owner(secret), _mode(secret)) == ((SERVICE, group), 0o600)
    assert _mode(public) == 0o644
    assert (_owner(keys), _mode(keys)) == (("root", group), 0o750)
    assert (_owner(clients), _mode(clients)) == (("root", group), 0o750)
    assert list(clients.iterdir()) == []
    out = capsys.readouterr().out
    assert f"The secret file belongs to {SERVICE}, the directories keygen made to the group {group}." in out
    assert _readable_as(SERVICE, secret, clients)
    # The same files owned as keygen made them before: the service user is locked out.
    os.chown(secret, 0, 0)
    assert not _readable_as(SERVICE, secret, clients)


def _without_chown() -> None:
    """In the child: lose the right to give files away, as any user but root lacks it."""
    if os.geteuid() == 0:
        pr_capbset_drop, cap_chown = 24, 0
        assert ctypes.CDLL(None, use_errno=True).prctl(pr_capbset_drop, cap_chown, 0, 0, 0) == 0


def test_without_the_right_to_chown_keygen_prints_the_exact_commands(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    result = subprocess.run(
        edged_command("keygen", str(keys), "--user", SERVICE),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_without_chown,
    )
    assert result.returncode == 0, result.stderr
    group = grp.getgrgid(pwd.getpwnam(SERVICE).pw_gid).gr_name
    command = f"sudo chgrp {group} {keys} {keys / 'clients'} && sudo chown {SERVICE}:{group} {keys / 'server.key_secret'}"
    assert f"Only root may give them to the user {SERVICE!r} edged runs as; run:\n  {command}\n" in result.stdout
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert _owner(keys / "server.key_secret")[0] == me  # nothing half-done
    if os.geteuid() == 0:  # the printed commands, run as root, finish the job
        for step in command.split(" && "):
            subprocess.run(shlex.split(step.removeprefix("sudo ")), check=True)
        assert _owner(keys / "server.key_secret") == (SERVICE, group)
        assert _owner(keys / "clients")[1] == group


def test_keygen_for_the_publisher_twice_keeps_the_first_pair_and_its_clients(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert main(["keygen", str(keys)]) == 0
    (keys / "clients" / "line3.key").write_text("kept")
    before = (keys / "server.key_secret").read_bytes()
    assert main(["keygen", str(keys)]) == 1
    assert (keys / "server.key_secret").read_bytes() == before
    assert (keys / "clients" / "line3.key").read_text() == "kept"


def test_keygen_under_a_file_names_the_file_not_the_errno(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It said "cannot write afile: File exists", which reads as a key already there.
    (tmp_path / "afile").write_text("")
    for args in (["afile/sub"], ["afile/sub", "--name", "line3"], ["afile"]):
        assert main(["keygen", str(tmp_path / args[0]), *args[1:]]) == 1
        assert f"{tmp_path / 'afile'} is a file, not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# ---- the README, word for word ----------------------------------------------------------------


def _securing_section() -> str:
    text = README.read_text()
    return text[text.index("## Securing the stream") : text.index("\n## ", text.index("## Securing the stream") + 1)]


def test_the_readme_key_setup_works_as_written(tmp_path: Path) -> None:
    """The README's commands and settings, run as written with only the machine's paths moved into a temp dir."""
    section = _securing_section()
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "the README no longer shows the key setup as a sh block"
    settings = dict(re.findall(r'`publish\.(curve_\w+) = "([^"]+)"`', section))
    assert set(settings) == {"curve_server_key", "curve_clients_dir"}, settings
    subscribe = re.search(r"`(edged subscribe tcp://\S+ [^`]*)`", section)
    assert subscribe, "the README no longer shows how a subscriber connects"

    root = tmp_path / "board"

    def here(text: str) -> str:
        return text.replace("/etc/edged/", f"{root}/etc/edged/").replace("/tmp/line3", f"{tmp_path}/line3")

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "edged").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m edged "$@"\n')
    (bin_dir / "edged").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    setup = subprocess.run(["bash", "-euo", "pipefail", "-c", here(block.group(1))], env=env, capture_output=True, text=True)
    assert setup.returncode == 0, setup.stdout + setup.stderr

    colour_probe(tmp_path / "probe.onnx")
    write_video(tmp_path / "clip.avi", [(0, 0, 255), (255, 0, 0)] * 20)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
            "model": {"path": "probe.onnx"},
            "publish": {"endpoints": [endpoint], **{key: here(value) for key, value in settings.items()}},
            "thermal": {"enabled": False},
        },
    )
    daemon = RunningDaemon(config, endpoint)
    try:
        keys = Path(here(settings["curve_server_key"])).parent
        # The README's board and file names, here: its command as written otherwise.
        names = {"tcp://board:5556": endpoint, "server.key": str(keys / "server.key")}
        names["line3.key_secret"] = here("/tmp/line3/line3.key_secret")
        words = [names.get(w, w) for w in shlex.split(subscribe.group(1))]
        assert words[:2] == ["edged", "subscribe"]
        got = subprocess.run(
            [*edged_command(*words[1:]), "--json", "--count", "1", "--timeout", "60", "--topic", "edged/detections/"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert got.returncode == 0, got.stderr + daemon.log()
        assert DetectionsMessage.model_validate_json(got.stdout.splitlines()[0]).detections
        assert not daemon.sub.poll(200), "a plaintext subscriber received from the CURVE socket"
    finally:
        daemon.close()
