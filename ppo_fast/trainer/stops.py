"""Clean stops: the first Ctrl-C (or SIGTERM) ends the run after the current step, a second at once."""

from __future__ import annotations

import signal
import threading


class StopNow(KeyboardInterrupt):
    """A second Ctrl-C (or SIGTERM): the run stops at once, nothing more is saved or evaluated."""


class DeferredInterrupt:
    """Turns the first Ctrl-C (SIGINT) or SIGTERM (what schedulers send) into a request to stop
    after the current step; a second one interrupts at once."""

    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, log):
        self.requested = False
        self.log = log
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise StopNow
        self.requested = True
        self.log(f"{self.SIGNALS[signum]}: stopping after this step (again to stop at once)")

    def __exit__(self, *exc):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
