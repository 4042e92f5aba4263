"""ThreadedModule: a module whose work is one loop on its own thread (rollout workers, trainers).

The lifecycle lives here once: :meth:`run` starts the loop, :meth:`stop` asks it to end
and joins it, :meth:`health_check` / :meth:`get_status` tell the controller how it is
doing. Every method the controller uses is public: it reaches the module through
``execute`` on a handle, which is all a module in another process offers.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from typing import Any

from loguru import logger

from .module import NexRLModule


class ThreadedModule(NexRLModule):
    """Subclasses implement :meth:`_main_loop`, which returns once :meth:`_should_stop` is true
    (or its work is done). An exception escaping the loop ends it; the module then reports
    itself unhealthy and :meth:`get_last_error` describes the exception."""

    #: seconds :meth:`stop` waits for the loop to end
    STOP_JOIN_TIMEOUT_S: float = 60.0
    #: the controller ends the run with :meth:`get_last_error` as its error (a trainer's): the loop's
    #: end then goes to run.log only, so the console shows the message once
    LOOP_ERROR_ENDS_RUN: bool = False

    def __init__(self) -> None:
        super().__init__()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_error: BaseException | None = None

    # -- the loop ----------------------------------------------------------------------
    @abstractmethod
    def _main_loop(self) -> None:
        """The module's work; check :meth:`_should_stop` between units of work."""

    def _should_stop(self) -> bool:
        return self._stop_event.is_set()

    def _loop_body(self) -> None:
        try:
            self._main_loop()
        except Exception as exc:
            self._loop_error = exc
            logger.log("DEBUG" if self.LOOP_ERROR_ENDS_RUN else "ERROR",
                       f"{self._module_name}: its loop stopped: {type(exc).__name__}: {exc}")

    # -- lifecycle (public: called through execute) ---------------------------------------
    def run(self) -> None:
        """Start the loop on a new thread."""
        self._stop_event.clear()
        self._loop_error = None
        self._thread = threading.Thread(target=self._loop_body, name=self._module_name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to end after its current unit of work; returns at once."""
        self._stop_event.set()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end and wait for it (at most ``timeout``, default STOP_JOIN_TIMEOUT_S)."""
        self._stop_event.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.STOP_JOIN_TIMEOUT_S if timeout is None else timeout)

    def is_running(self) -> bool:
        """True while the loop's thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def get_last_error(self) -> str | None:
        """``"Type: message"`` of the exception that ended the loop, or None."""
        exc = self._loop_error
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    def health_problem(self) -> str | None:
        """Unhealthy when the loop ended by an exception, or ended by itself while it should still run."""
        alive = self._thread is None or self._thread.is_alive() or self._stop_event.is_set() or \
            (self._loop_error is None and self._loop_finished_normally())
        if not alive:
            return f"its loop ended: {self.get_last_error()}" if self._loop_error is not None else "its loop ended"
        return super().health_problem()

    def _loop_finished_normally(self) -> bool:
        """Whether a loop that returned by itself (no stop asked) did its job (e.g. a trainer that is done)."""
        return False

    def get_status(self) -> dict[str, Any]:
        """One call's worth of what the controller's monitor needs (running, last error)."""
        return {"running": self.is_running(), "last_error": self.get_last_error()}
