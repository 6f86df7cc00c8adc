"""CurveZMQ key files: create them (``edged keygen``), load them, and refuse unsafe ones.

Keys are zmq.auth certificates: ``NAME.key`` holds the public key and may be copied anywhere;
``NAME.key_secret`` holds both keys and must stay readable by its owner only, as ssh demands of
private keys, because whoever reads it can impersonate the publisher (or that subscriber).

Every error is a `KeyFileError` whose message starts with the setting that names the file
(``publish.curve_server_key: …`` or ``--client-key: …``): it is a configuration problem, so the
daemon exits 78 on it and systemd does not restart it in a loop.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import zmq
import zmq.auth

from edged.errors import KeyFileError

Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
KEY_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e)


def _check_private(path: Path, label: str) -> None:
    """Refuse a secret key that anyone but its owner can read or write."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise KeyFileError(f"{label}: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{label}: cannot read {path}: {_reason(e)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{label}: {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise KeyFileError(
            f"{label}: permissions {mode:04o} on {path} are too open; a secret key must be "
            f"accessible by its owner only (chmod 600 {path})"
        )


def _read_certificate(path: Path, label: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise KeyFileError(f"{label}: cannot read {path}: {_reason(e)}") from None
    except ValueError:
        raise KeyFileError(f"{label}: {path} is not a zmq certificate (no public-key line)") from None
    for key in (public, secret):
        if key is not None and not Z85_KEY.match(key.decode("latin-1")):
            raise KeyFileError(f"{label}: {path} holds a malformed key (expected 40 Z85 characters)")
    return public, secret


def load_secret_key(path: Path, label: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file that only its owner can read."""
    _check_private(path, label)
    public, secret = _read_certificate(path, label)
    if secret is None:
        raise KeyFileError(f"{label}: {path} has no secret key; pass the .key_secret file, not the .key")
    if zmq.curve_public(secret) != public:
        raise KeyFileError(f"{label}: the public and secret keys in {path} do not belong together")
    return public, secret


def load_public_key(path: Path, label: str) -> bytes:
    """The public key of a certificate (either file of a pair will do)."""
    try:
        is_file = path.is_file()
    except OSError as e:
        raise KeyFileError(f"{label}: cannot read {path}: {_reason(e)}") from None
    if not is_file:
        raise KeyFileError(f"{label}: {path} does not exist or is not a file")
    return _read_certificate(path, label)[0]


def load_allowed_clients(directory: Path, label: str) -> frozenset[bytes]:
    """The public keys of every ``*.key`` in the allow-list directory, each file checked.

    Every file is read here, and a bad one named: the set is what the CURVE authenticator admits.
    """
    try:
        files = sorted(directory.glob("*.key")) if directory.is_dir() else None
    except OSError as e:
        raise KeyFileError(f"{label}: cannot read {directory}: {_reason(e)}") from None
    if files is None:
        raise KeyFileError(f"{label}: {directory} does not exist or is not a directory")
    return frozenset(_read_certificate(path, label)[0] for path in files)


def key_file_problems(server_key: Path | None, clients_dir: Path | None) -> list[str]:
    """Config-check form of the loaders: one line per problem, each starting with its key path."""
    problems = []
    try:
        if server_key is not None:
            load_secret_key(server_key, "publish.curve_server_key")
    except KeyFileError as e:
        problems.append(str(e))
    try:
        if clients_dir is not None:
            load_allowed_clients(clients_dir, "publish.curve_clients_dir")
    except KeyFileError as e:
        problems.append(str(e))
    return problems


@dataclass(frozen=True)
class ClientKeys:
    """What a subscriber needs to reach a CURVE publisher: its own pair and the server's public key."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_key: Path, client_key: Path) -> ClientKeys:
        public, secret = load_secret_key(client_key, "--client-key")
        return cls(load_public_key(server_key, "--server-key"), public, secret)

    def apply(self, socket: zmq.Socket[bytes]) -> None:
        """Set the CURVE client options; must happen before connect."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.server_public


def create_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (0644) and NAME.key_secret (0600); never overwrites an existing pair."""
    if not KEY_NAME.match(name):
        raise KeyFileError(f"--name: {name!r} may only hold letters, digits, _ . -")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise KeyFileError(f"{path} already exists; remove it first to replace the key pair")
    directory.mkdir(parents=True, exist_ok=True, mode=0o750)
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old_umask)
    public.chmod(0o644)
    secret.chmod(0o600)
    return public, secret


def run_keygen(directory: Path, name: str, out: TextIO | None = None) -> int:
    """``edged keygen``: create a pair and say where each file goes."""
    try:
        public, secret = create_key_pair(directory, name)
    except KeyFileError as e:
        print(f"edged keygen: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"edged keygen: cannot write {e.filename or directory}: {e.strerror}", file=sys.stderr)
        return 1
    print(_where_they_go(name, public.resolve(), secret.resolve()), file=out or sys.stdout)
    return 0


def _where_they_go(name: str, public: Path, secret: Path) -> str:
    made = f"created the {name} key pair:\n  {secret}  secret, mode 0600\n  {public}  public, mode 0644\n"
    if name == "server":
        return made + (
            f"The service must own the secret file: chown edged: {secret}\n"
            f'On the publisher, in edged.toml:\n  [publish]\n  curve_server_key = "{secret}"\n'
            f'  curve_clients_dir = "{public.parent / "clients"}"  # allowed subscribers\' public keys\n'
            f"Subscribers need the public file: edged subscribe tcp://HOST:PORT --server-key {public} "
            "--client-key CLIENT.key_secret"
        )
    return made + (
        f"Copy {public} into the publisher's publish.curve_clients_dir, then reload edged there (systemctl reload edged).\n"
        f"Keep {secret} here: edged subscribe tcp://HOST:PORT --server-key server.key --client-key {secret}"
    )
