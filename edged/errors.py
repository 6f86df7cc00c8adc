"""Every error edged raises on purpose, and the exit code a command ends with because of it.

::

    EdgedError                 exit
    ├── ConfigError              78  the configuration cannot be used (one line per problem)
    ├── ModelError               78  the model file cannot be loaded or run at all
    ├── ContractError            78  the model, the config and the camera disagree on the layout
    │   └── HeadError            78  the output is not a detection head edged can decode
    ├── KeyFileError             78  a CURVE key, password or TLS key file is missing, malformed or too open
    ├── MissingDependency        78  an optional package the configuration needs is not installed
    ├── LineError                78  the reject line's chip or line does not exist (the chip's lines named)
    ├── DataError                65  a tool's data (images, labels) cannot be used
    │   └── ImageError           65  an image file cannot be decoded, or must not be (cut short, too large)
    ├── UsageError                2  command-line options that cannot work together
    ├── BindError                 1  an endpoint edged listens on is in use or cannot be bound
    │   └── PublishError          1  a ZeroMQ socket (publish, trigger) cannot bind, or may not
    ├── FolderError               1  ``edged check``: a folder edged writes to takes no file
    ├── BrokerError               1  ``edged check``: the MQTT broker cannot be reached or refuses edged
    ├── SourceError               1  the camera is gone or cannot be opened; capture retries
    ├── InferenceError            1  one run failed; the frame is skipped and counted
    ├── QuantizeError             1  quantising, or running the quantised model, failed
    ├── OutputFileError           1  a file a command writes cannot be written (no space, no permission)
    ├── ColdStartError            1  ``edged bench --cold-start``: the daemon exited or published nothing
    ├── MessageError              1  a received payload is not a valid edged message
    ├── TriggerFailed             1  ``edged trigger``: an error reply, or no reply in time
    ├── JournalUnreadable         1  ``edged history``: no journal there, or it cannot be read
    └── LineBusy                  1  the reject line is held by another process (its consumer named)

78 is sysexits' EX_CONFIG: the units set ``RestartPreventExitStatus=78``, so systemd does not
restart a daemon that can only fail the same way again. Nothing else exits 78.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import ClassVar

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # as argparse
EXIT_DATA = 65  # EX_DATAERR
EXIT_CONFIG = 78  # EX_CONFIG

# What an OSError (or libzmq's ZMQError, which carries an errno too) says when the process or the
# system has no descriptor or memory to give: the process's want, not the file's, the client's or the
# configuration's, so never exit 78 and never an input skipped for it.
OUT_OF_ROOM = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def out_of_room(error: BaseException | None) -> bool:
    """Whether ``error`` is for want of a descriptor or memory (`OUT_OF_ROOM`)."""
    return getattr(error, "errno", None) in OUT_OF_ROOM


class EdgedError(Exception):
    """Base of every error edged raises on purpose; ``exit_code`` is what a command exits with."""

    exit_code: ClassVar[int] = EXIT_FAILURE


class SetupError(EdgedError):
    """What is set up is wrong (configuration, model, contract, a key file, a missing package): exit
    78, which systemd does not restart, since starting again cannot help. Nothing else exits 78."""

    exit_code = EXIT_CONFIG


class ConfigError(SetupError):
    """A configuration the daemon must not start with; ``problems`` holds one line each."""

    def __init__(self, path: Path | None, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        where = f" in {path}" if path else ""
        super().__init__(f"{len(problems)} problem(s){where}:\n" + "\n".join(f"  - {p}" for p in problems))


class ModelError(SetupError):
    """The model cannot be loaded or run at all; the daemon must not start with it."""


class ContractError(SetupError):
    """The model cannot be fed correctly from this source with this config."""


class HeadError(ContractError):
    """The model's output does not match a supported detection head."""


class KeyFileError(SetupError):
    """A CURVE key file or directory, or a secret file (a password, a TLS key), is missing, malformed or too open."""


class MissingDependency(SetupError):
    """An optional package that this configuration or command needs is not installed."""


class LineError(SetupError):
    """The reject line's GPIO chip or line does not exist, or cannot be an output; the message names
    the chips found, or the chip's lines."""


class DataError(EdgedError):
    """A tool's data set (images, labels) cannot be used."""

    exit_code = EXIT_DATA


class ImageError(DataError):
    """An image file that cannot be decoded, or must not be (cut short, too large); ``why`` says which.

    The tools stop on it naming the file; the images source skips the file and counts it.
    """

    def __init__(self, path: str, why: str) -> None:
        self.why = why
        super().__init__(f"cannot decode image {path} ({why})")


class UsageError(EdgedError):
    """Command-line options that cannot work together."""

    exit_code = EXIT_USAGE


class BindError(EdgedError):
    """An endpoint edged listens on is in use or cannot be bound; the message names its key and address.

    Not exit 78: the same configuration starts once the other program lets go of the address.
    ``in_use``: another socket holds the address (beside the running service, perhaps its own).
    """

    def __init__(self, message: str, *, in_use: bool = False) -> None:
        super().__init__(message)
        self.in_use = in_use


class PublishError(BindError):
    """A ZeroMQ socket cannot bind, or may not where it is asked to; the message names the endpoint and what to check."""


class FolderError(EdgedError):
    """``edged check``: a folder edged writes to (evidence, the journal's, ``opcua.cert_dir``) takes no file; the message
    names the key and the reason."""


class BrokerError(EdgedError):
    """The MQTT broker cannot be reached, refuses the connection or fails TLS; the message has its reason.

    Only ``edged check`` raises it: the running daemon retries with backoff and reports its state.
    """


class SourceError(EdgedError):
    """The camera is gone or cannot be opened; the message says what to check."""


class InferenceError(EdgedError):
    """One run failed (a provider error); the frame is skipped and counted."""


class QuantizeError(EdgedError):
    """Quantising failed, or the quantised model does not load or run."""


class OutputFileError(EdgedError):
    """A file a command writes (a report, a model, a signature) cannot be written; the message says
    why. Nothing half-written is left in its place (`edged.files.write_whole`)."""


class ColdStartError(EdgedError):
    """A daemon started by ``edged bench --cold-start`` or ``--cameras`` exited or published nothing;
    the message says which, with its stderr where there is one."""


class MessageError(EdgedError, ValueError):
    """A payload that is not a valid edged message."""


class TriggerFailed(EdgedError):
    """``edged trigger`` got no verdict: the daemon said why (an error reply), or nothing came in time."""


class JournalUnreadable(EdgedError):
    """``edged history``: the journal file is not there or cannot be read; the message says which."""


class LineBusy(EdgedError):
    """The reject line is held by another process; the message names its consumer where the kernel
    says it. Not exit 78: the same configuration starts once the other program lets go of the line."""


class ControlError(EdgedError):
    """``edged promote`` or ``edged rollback``: the daemon refused the command, or did not answer."""


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\n`` for a line feed), so that a name with one
    (a file's, a path given in a variable) cannot break a log line or a problem in two or forge the next."""
    return _CONTROL.sub(lambda m: repr(m[0])[1:-1], text)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
