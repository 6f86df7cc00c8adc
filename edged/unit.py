"""The systemd unit that runs a configuration, as `edged check` run as root needs to see it.

``sudo edged check`` tries each folder edged writes as root, who may write anywhere; the service
runs as its ``User=`` inside ``ProtectSystem=strict``, where only its state, cache, runtime and
logs directories, ``ReadWritePaths=`` and a private /tmp are writable. A folder root can write and
the service cannot passed the check, and every save then failed. `Unit.cannot_write` says so for
the unit that runs the configuration (`unit_for`: the packaged units read ``/etc/edged/NAME.toml``),
from what ``systemctl show`` says of it (drop-ins included), trying the folder as its user.

The service's folders follow the directories systemd makes for it (``$STATE_DIRECTORY`` and
``$RUNTIME_DIRECTORY``: evidence, the journal, the OPC UA certificate, ipc sockets), which a shell
does not have: `Unit.environment` gives them to the check as systemd gives them to the service, so
that it tries the folders the service writes, not those beside the configuration file.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from edged.files import nearest_folder

CONFIG_DIR = Path("/etc/edged")  # the packaged units' configuration folder (ExecStart --config)
SHOWN = (
    "LoadState",
    "User",
    "Group",
    "SupplementaryGroups",
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "ReadWritePaths",
    "StateDirectory",
    "CacheDirectory",
    "RuntimeDirectory",
    "LogsDirectory",
)
# Where systemd makes each *Directory= (its names are relative to these).
DIRECTORY_ROOTS = {
    "StateDirectory": "/var/lib",
    "CacheDirectory": "/var/cache",
    "RuntimeDirectory": "/run",
    "LogsDirectory": "/var/log",
}
# The directories whose variables the check takes on (`Unit.environment`); not the cache, where a check
# run as root would leave root's files among the service's own.
FOLLOWED = {"StateDirectory": "STATE_DIRECTORY", "RuntimeDirectory": "RUNTIME_DIRECTORY"}
HOMES = ("/home", "/root", "/run/user")  # ProtectHome=
SYSTEMCTL_TIMEOUT_S = 10.0


def unit_for(config: Path) -> str | None:
    """The packaged unit whose ``ExecStart`` reads ``config``: edged.service for /etc/edged/edged.toml,
    edged@NAME.service for /etc/edged/NAME.toml; None for a configuration elsewhere."""
    config = config.resolve()
    if config.parent != CONFIG_DIR or config.suffix != ".toml":
        return None
    return "edged.service" if config.stem == "edged" else f"edged@{config.stem}.service"


@dataclass(frozen=True, slots=True)
class Unit:
    """What ``systemctl show`` says of a unit: its user and groups, and the places its sandbox leaves
    writable (``writable`` is None where it does not make the system read-only)."""

    name: str
    user: str | None
    groups: tuple[str, ...]
    writable: tuple[Path, ...] | None
    homes: str  # ProtectHome=: "no", "yes" (inaccessible), "read-only" or "tmpfs"
    directories: dict[str, tuple[Path, ...]]  # by property (StateDirectory=...): systemd makes them, the user's
    # `cannot_write`'s answers by folder: a check asks of one folder for each camera that writes there,
    # and each asking runs test(1) as the user
    _answers: dict[Path, str | None] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, name: str, shown: str) -> Unit | None:
        """From ``systemctl show -p ...`` output; None for a unit systemd does not have."""
        props = dict(line.partition("=")[::2] for line in shown.splitlines() if "=" in line)
        if props.get("LoadState") != "loaded":
            return None
        directories = {
            key: tuple(Path(root, d) for d in props.get(key, "").split()) for key, root in DIRECTORY_ROOTS.items()
        }
        writable = None
        if props.get("ProtectSystem") == "strict":
            places = [Path(p.lstrip("-+")) for p in props.get("ReadWritePaths", "").split()]
            places += [d for made in directories.values() for d in made]
            if props.get("PrivateTmp") == "yes":
                places += [Path("/tmp"), Path("/var/tmp")]
            writable = tuple(places)
        groups = tuple(g for g in (props.get("Group", ""), *props.get("SupplementaryGroups", "").split()) if g)
        return cls(name, props.get("User") or None, groups, writable, props.get("ProtectHome", "no"), directories)

    @classmethod
    def checked_as(cls, config: Path | None) -> Unit | None:
        """The packaged unit that runs ``config`` (`unit_for`) where root checks it, root being able to write
        where the service cannot; None otherwise."""
        if config is None or os.geteuid() != 0 or (name := unit_for(config)) is None:
            return None
        return cls.load(name)

    @classmethod
    def load(cls, name: str) -> Unit | None:
        """The unit as systemd has it now; None where there is no systemd or no such unit."""
        systemctl = shutil.which("systemctl")
        if systemctl is None:
            return None
        try:
            shown = subprocess.run(
                [systemctl, "show", name, *(f"--property={p}" for p in SHOWN)],
                capture_output=True,
                text=True,
                timeout=SYSTEMCTL_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return cls.parse(name, shown.stdout) if shown.returncode == 0 else None

    def environment(self) -> dict[str, str]:
        """The variables systemd sets for the service's state and runtime directories (``:``-joined, as
        systemd joins several), for those the unit has."""
        return {var: ":".join(map(str, made)) for key, var in FOLLOWED.items() if (made := self.directories[key])}

    def cannot_write(self, folder: Path) -> str | None:
        """Why this unit's process could not write in ``folder`` (or, where it is still to be made, the
        nearest folder above it), though root can; None where it can."""
        folder = Path(os.path.abspath(folder))
        if folder not in self._answers:
            self._answers[folder] = self._problem(folder)
        return self._answers[folder]

    def _problem(self, folder: Path) -> str | None:
        if self.homes in ("yes", "read-only", "tmpfs") and any(_within(folder, Path(h)) for h in HOMES):
            return (
                f"{self.name}'s ProtectHome={self.homes} hides {folder} from it (or empties it): "
                "give a folder outside /home and /root"
            )
        if self.writable is not None and not any(_within(folder, place) for place in self.writable):
            return (
                f"{self.name}'s ProtectSystem=strict keeps {folder} read-only: add ReadWritePaths={folder} "
                f"with systemctl edit {self.name}"
            )
        return self._as_user(folder)

    def _as_user(self, folder: Path) -> str | None:
        """Whether the unit's ``User=`` with its groups may make files in ``folder``'s nearest existing
        folder (`test -w` and `-x`, asked as that user); None where it may, or where it is root or gone."""
        if self.user is None or self.user == "root" or os.geteuid() != 0:
            return None
        try:
            account = pwd.getpwnam(self.user)
        except KeyError:
            return None
        groups = set(os.getgrouplist(self.user, account.pw_gid))
        for name in self.groups:
            try:
                groups.add(grp.getgrnam(name).gr_gid)
            except KeyError:  # a group the system lacks fails the unit's own start, not this
                continue
        above = nearest_folder(folder)
        if any(_within(folder, d) and not _within(above, d) for made in self.directories.values() for d in made):
            return None  # within a directory systemd is still to make, for the user, when the service starts
        test = shutil.which("test") or "/usr/bin/test"
        allowed = subprocess.run(
            [test, "-w", str(above), "-a", "-x", str(above)],
            user=account.pw_uid,
            group=account.pw_gid,
            extra_groups=sorted(groups),
            env={},
            check=False,
            timeout=SYSTEMCTL_TIMEOUT_S,
        )
        if allowed.returncode == 0:
            return None
        return f"{self.name} runs as {self.user}, who may not write in {above}: chown {self.user} {above}, or give another"


def _within(path: Path, place: Path) -> bool:
    return path == place or place in path.parents
