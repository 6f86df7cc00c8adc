"""``python -m edged`` and the installed ``edged`` command (pyproject's entry point).

On a small board the first second of a command goes to importing edged's modules, before
`edged.cli.main` handles Ctrl-C itself. A Ctrl-C there ended the command with a traceback; one
that landed in a compiled module's start (pydantic's core) made it panic instead. It is held until
the modules are in, then ends the command as main's own handling does, without a traceback. Where
it was ignored (``trap '' INT``, a script's background job), it stays ignored.
"""

import signal
import sys
from types import FrameType


def main() -> int:
    held: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        held.append(signum)

    default = signal.getsignal(signal.SIGINT)
    if default is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, hold)
    try:
        from edged.cli import main as command
    finally:
        signal.signal(signal.SIGINT, default)
    try:
        if held:
            raise KeyboardInterrupt
        return command()
    except KeyboardInterrupt:  # here, or in the command before its own handling (its arguments parsed)
        print("edged: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
