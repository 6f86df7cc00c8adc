"""CurveZMQ key files and other secrets: create them (``edged keygen``), load them, and refuse unsafe ones.

Keys are zmq.auth certificates: ``NAME.key`` holds the public key and may be copied anywhere;
``NAME.key_secret`` holds both keys and must stay readable by its owner only, as ssh demands of
private keys, because whoever reads it can impersonate the publisher (or that subscriber).

The HTTP bearer token (``http.token_file``) is held to the same rule as a secret key.

Every error is a `KeyFileError` whose message starts with the setting that names the file
(``publish.curve_server_key: …`` or ``--client-key: …``): it is a configuration problem, so the
daemon exits 78 on it and systemd does not restart it in a loop.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shlex
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import zmq
import zmq.auth

from edged.errors import KeyFileError, UsageError

Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
KEY_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
MIN_TOKEN_CHARS = 16  # a guessable token is no protection on a network


def _reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e)


def check_secret_file(path: Path, label: str, *, group_readable: bool = False) -> None:
    """Refuse a secret file that others can read or write, as ssh refuses a private key.

    A key pair's secret is its owner's alone; a password file may also be read by the service's
    group (``group_readable``: a 0640 file owned by root and the service group), never written.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise KeyFileError(f"{label}: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{label}: cannot read {path}: {_reason(e)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{label}: {path} is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & (0o037 if group_readable else 0o077):
        allowed = "its owner, and read by its group" if group_readable else "its owner only"
        fix = "chmod 640" if group_readable else "chmod 600"
        raise KeyFileError(
            f"{label}: permissions {mode:04o} on {path} are too open; a secret file must be "
            f"accessible by {allowed} ({fix} {path})"
        )


def read_token(path: Path, label: str) -> str:
    """A bearer token: the first line of a file only its owner can read, at least 16 characters."""
    check_secret_file(path, label)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"{label}: cannot read {path}: {_reason(e)}") from None
    token = text.strip().split("\n", 1)[0].strip() if text.strip() else ""
    if len(token) < MIN_TOKEN_CHARS:
        raise KeyFileError(
            f"{label}: {path} holds a token of {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(e.g. `openssl rand -hex 32 > FILE; chmod 600 FILE`)"
        )
    return token


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
    check_secret_file(path, label)
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


def open_to_others(directory: Path) -> str | None:
    """Who besides its owner may add a file to ``directory`` ("its group", "everyone"), or None. A
    key put in the allow-list folder lets its holder in at the next reload: the folder is as much a
    secret to write as a secret key is to read (ssh's StrictModes looks at it so too)."""
    try:
        mode = directory.stat().st_mode
    except OSError:
        return None  # the loader says why it cannot be read
    if mode & stat.S_IWOTH:
        return "everyone"
    return "its group" if mode & stat.S_IWGRP else None


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

    @classmethod
    def from_options(cls, server_key: Path | None, client_key: Path | None) -> ClientKeys | None:
        """``--server-key`` and ``--client-key`` of a client command: both (CURVE) or neither (plaintext)."""
        if (server_key is None) != (client_key is None):
            raise UsageError("--server-key and --client-key go together")
        return cls.from_files(server_key, client_key) if server_key and client_key else None

    def apply(self, socket: zmq.Socket[bytes]) -> None:
        """Set the CURVE client options; must happen before connect."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.server_public


SERVICE_USER = "edged"  # the user the shipped units run edged as (User= and Group= in systemd/edged.service)
PUBLISHER = "server"  # the name of the publisher's pair; any other name is a subscriber's


def create_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (0644) and NAME.key_secret (0600); never overwrites an existing pair."""
    if not KEY_NAME.match(name):
        raise KeyFileError(f"--name: {name!r} may only hold letters, digits, _ . -")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise KeyFileError(f"{path} already exists; remove it first to replace the key pair")
    _make_private_dir(directory)
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old_umask)
    public.chmod(0o644)
    secret.chmod(0o600)
    return public, secret


def _make_private_dir(directory: Path) -> bool:
    """Create ``directory`` 0750 whatever the umask; True when it was created here.

    Missing parents become 0755: they hold nothing secret, and under root's umask 077 they would
    shut the service out of the keys below them.
    """
    if directory.is_dir():
        return False
    for parent in [*reversed(directory.parents), directory]:
        if parent.exists() and not parent.is_dir():
            raise KeyFileError(f"{parent} is a file, not a directory: name a directory for the keys (DIR)")
    for parent in reversed(directory.parents):
        if not parent.is_dir():
            parent.mkdir()
            parent.chmod(0o755)
    directory.mkdir(mode=0o750)
    directory.chmod(0o750)
    return True


@dataclass(frozen=True)
class ServiceAccount:
    """The user edged runs as, and its group: who must read the publisher's keys."""

    user: str
    uid: int
    group: str
    gid: int

    @classmethod
    def lookup(cls, user: str) -> ServiceAccount | None:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            return None
        try:
            group = grp.getgrgid(entry.pw_gid).gr_name
        except KeyError:  # a primary group without a name: numeric, as chown takes it
            group = str(entry.pw_gid)
        return cls(user, entry.pw_uid, group, entry.pw_gid)


@dataclass(frozen=True)
class PublisherKeys:
    """The layout the README and ``publish.curve_*`` expect: the pair, and ``clients/`` for allowed keys."""

    public: Path
    secret: Path
    clients: Path
    made_dirs: tuple[Path, ...]  # the directories keygen created: their group becomes the service's

    def hand_over(self, account: ServiceAccount) -> str | None:
        """Let the service read its keys: the secret becomes its own, the directories its group's.

        Returns None when done, or the exact commands to run as root when this process may not
        change owners (not root).
        """
        try:
            for directory in self.made_dirs:
                os.chown(directory, -1, account.gid)
            os.chown(self.secret, account.uid, account.gid)
        except PermissionError:
            dirs = " ".join(shlex.quote(str(d)) for d in self.made_dirs)
            chgrp = f"sudo chgrp {account.group} {dirs} && " if dirs else ""
            return f"{chgrp}sudo chown {account.user}:{account.group} {shlex.quote(str(self.secret))}"
        return None


def create_publisher_keys(directory: Path) -> PublisherKeys:
    """The publisher's pair in ``directory`` and an empty ``clients/`` beside it, both directories 0750."""
    made = _make_private_dir(directory)
    public, secret = create_key_pair(directory, PUBLISHER)
    clients = directory / "clients"
    made_clients = _make_private_dir(clients)
    return PublisherKeys(public, secret, clients, tuple(d for d, new in ((directory, made), (clients, made_clients)) if new))


def run_keygen(directory: Path, name: str, user: str, out: TextIO | None = None) -> int:
    """``edged keygen``: create a pair (the publisher's with its layout and owners) and say where each file goes."""
    out = out or sys.stdout
    try:
        if name != PUBLISHER:
            public, secret = create_key_pair(directory, name)
            print(_where_a_subscriber_pair_goes(public.resolve(), secret.resolve()), file=out)
            return 0
        keys = create_publisher_keys(directory)
        account = ServiceAccount.lookup(user)
        command = keys.hand_over(account) if account else None
    except KeyFileError as e:
        print(f"edged keygen: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"edged keygen: cannot write {e.filename or directory}: {e.strerror}", file=sys.stderr)
        return 1
    print(_where_the_publisher_keys_go(keys, user, account, command), file=out)
    return 0


def _where_the_publisher_keys_go(keys: PublisherKeys, user: str, account: ServiceAccount | None, command: str | None) -> str:
    public, secret, clients = keys.public.resolve(), keys.secret.resolve(), keys.clients.resolve()
    if account is None:
        owner = (
            f"There is no user {user!r} here: the files are yours, so edged must run as you "
            "(or pass --user USER, the user it runs as).\n"
        )
    elif command is not None:
        owner = f"Only root may give them to the user {account.user!r} edged runs as; run:\n  {command}\n"
    else:
        owner = f"The secret file belongs to {account.user}, the directories keygen made to the group {account.group}.\n"
    return (
        f"created the server key pair:\n  {secret}  secret, mode 0600\n  {public}  public, mode 0644\n"
        f"  {clients}/  the allowed subscribers' public keys, mode 0750\n"
        + owner
        + f'On the publisher, in edged.toml:\n  [publish]\n  curve_server_key = "{secret}"\n'
        f'  curve_clients_dir = "{clients}"\n'
        f"Subscribers need the public file: edged subscribe tcp://HOST:PORT --server-key {public} "
        "--client-key CLIENT.key_secret"
    )


def _where_a_subscriber_pair_goes(public: Path, secret: Path) -> str:
    return (
        f"created the {public.stem} key pair:\n  {secret}  secret, mode 0600\n  {public}  public, mode 0644\n"
        f"Copy {public} into the publisher's publish.curve_clients_dir, then reload edged there (systemctl reload edged).\n"
        f"Keep {secret} here: edged subscribe tcp://HOST:PORT --server-key server.key --client-key {secret}"
    )
