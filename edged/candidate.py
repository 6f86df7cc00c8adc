"""``[model.candidate]`` as the loop runs it: the shadow trial (`edged.shadow`) and the control
socket that promotes or rolls it back (`edged.control`), behind the few calls the daemon makes.

The control socket is bound at start and stays for the process's life; a reload replaces the
trial (or ends it, when the candidate is gone), and one that adds a candidate to a daemon started
without one asks for a restart, since the socket cannot be bound then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from edged.camera import Camera
from edged.config import CandidateConfig, Settings
from edged.control import ControlSocket
from edged.journal import JournalOutput
from edged.messages import CandidateReport
from edged.pipeline import Processed
from edged.requests import RequestDesk
from edged.shadow import Shadow, Swap

log = logging.getLogger(__name__)


class Candidate:
    """The trial of a candidate model and its control socket; raises as `ControlSocket` does."""

    def __init__(self, settings: Settings, cfg: CandidateConfig) -> None:
        self.control = ControlSocket(cfg.control)
        try:
            self.shadow: Shadow | None = Shadow(settings, cfg)
        except BaseException:
            self.control.close()
            raise

    @classmethod
    def configured(cls, settings: Settings) -> Candidate | None:
        cfg = settings.model.candidate
        return cls(settings, cfg) if cfg is not None else None

    @property
    def fds(self) -> list[Any]:
        """What the loop's wait selects on: commands arriving."""
        return self.control.fds

    def serve(
        self, current: Callable[[], Swap], apply: Callable[[Swap], None], blocked: str | None, journal: JournalOutput | None
    ) -> None:
        """Answer the commands waiting (`ControlSocket.serve`); none is taken without a trial."""
        if self.shadow is not None:
            self.control.serve(self.shadow, current, apply, blocked, journal)

    def observe(self, camera_id: str, done: Processed) -> None:
        if self.shadow is not None:
            self.shadow.observe(camera_id, done)

    def run(self, cameras: Sequence[Camera], desk: RequestDesk | None) -> bool:
        """Run the candidate in the time the loop would wait, if it fits (`Shadow.spare_s`)."""
        return self.shadow is not None and self.shadow.run(self.shadow.spare_s(cameras, desk))

    def report(self) -> CandidateReport | None:
        return self.shadow.report() if self.shadow is not None else None

    def reload(self, settings: Settings) -> None:
        """A reload's candidate goes on a fresh trial; without one, the trial ends."""
        if self.shadow is not None:
            self.shadow.close()
        cfg = settings.model.candidate
        self.shadow = Shadow(settings, cfg) if cfg is not None else None

    def close(self) -> None:
        if self.shadow is not None:
            self.shadow.close()
        self.control.close()


def added_by_reload(settings: Settings) -> None:
    """A reload that adds a candidate to a daemon started without one: said, not served."""
    if settings.model.candidate is not None:
        log.warning("[model.candidate] added by a reload: restart edged to bind its control socket")
