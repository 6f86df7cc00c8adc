"""``python -m edged`` and the installed ``edged`` command (pyproject's entry point).

On a small board the first second of a command goes to importing edged's modules, before
`edged.cli.main` handles Ctrl-C itself. A Ctrl-C there ended the command with a traceback; one
that landed in a compiled module's start (pydantic's core) made it panic instead. It is held until
the modules are in, then handed to main, which ends the command as its own handling of Ctrl-C does
(exit 130, or 0 for ``edged subscribe``, which Ctrl-C ends), without a traceback. Where it was
ignored (``trap '' INT``, a script's background job), it stays ignored.
"""

import signal
import sys
from collections.abc import Callable
from types import FrameType


def main() -> int:
    held: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        held.append(signum)

    default = signal.getsignal(signal.SIGINT)
    if default is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, hold)
    try:
        command = _command()
    finally:
        signal.signal(signal.SIGINT, default)
    try:
        return command(interrupted=bool(held))
    except KeyboardInterrupt:  # in the command before its own handling: while its arguments are parsed
        print("edged: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def _command() -> Callable[..., int]:
    """`edged.cli.main`, with every module that builds pydantic models as it is imported. A Ctrl-C
    raised inside pydantic's core as it builds one comes out as its SchemaError, a traceback and exit
    1: so it was as `edged subscribe` imported `edged.messages` (its models) after the hold."""
    import edged.messages  # noqa: F401  (the messages' models; the settings' come with edged.cli)
    from edged.cli import main

    return main


if __name__ == "__main__":
    sys.exit(main())
