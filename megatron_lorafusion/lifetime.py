"""Processes that never outlive the process that started them, and stop only with it.

A planner worker whose trainer was killed, or a torchrun rank whose launcher was, would
otherwise run on (blocked on a queue or a collective), holding memory and a GPU. On Linux
the kernel kills such a process when its parent dies (``PR_SET_PDEATHSIG``); elsewhere
callers that wait check `parent_alive` in their loop. A helper process also shares the
terminal's process group, so Ctrl-C reaches it too: `started_deaf` and `ignore_ctrl_c` keep
it out of that (its parent stops it); the parent ends on the first one (`StopSignals`).
No other package imports here: every layer may use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

__all__ = [
    "StopSignals",
    "Terminated",
    "command_age_s",
    "die_with_parent",
    "ignore_ctrl_c",
    "note_command_start",
    "parent_alive",
    "started_deaf",
]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_command_start: list[float] = []  # perf_counter when the `lorafusion` command began


def note_command_start() -> None:
    """This process is the `lorafusion` command, beginning now (`__main__.run` says so first)."""
    _command_start[:] = [time.perf_counter()]


def command_age_s() -> float | None:
    """Seconds since the `lorafusion` command began (its imports included).

    None in any other program (a test or a script that calls `train.main` itself).
    """
    return time.perf_counter() - _command_start[0] if _command_start else None


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux).

    Args:
        parent_pid: the parent's pid as the parent saw it (``os.getpid()`` there), so a
            parent that died before the request took effect is caught too: this process
            then exits at once.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if not parent_alive(parent_pid):
        os._exit(1)


def parent_alive(parent_pid: int) -> bool:
    """Whether the process that started this one (``parent_pid``) is still its parent."""
    return os.getppid() == parent_pid


_STOPS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def started_deaf() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back from this thread while a child process is started.

    A child started inside (fork, or spawn's fork and exec) inherits the blocked signals, so
    a Ctrl-C during its interpreter's start-up stays pending instead of raising a
    `KeyboardInterrupt` traceback in it; the child calls `ignore_ctrl_c` once running. Here
    a signal that arrives meanwhile is delivered on leaving (or to another thread).
    """
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_ctrl_c() -> None:
    """In a helper process: ignore SIGINT, then take the signals `started_deaf` held back.

    Ctrl-C goes to the terminal's whole process group; the parent handles it and stops this
    process. SIGTERM keeps its default action, ending this process at once and silently:
    that is how the parent (``Process.terminate``) and multiprocessing's exit hook stop it,
    so ignoring it would leave them waiting.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so a run unwinds as on Ctrl-C (children stopped)."""


class StopSignals:
    """SIGINT and SIGTERM for a command: the first stops it, the next few are ignored.

    The first raises `KeyboardInterrupt` (`Terminated` for SIGTERM) in the main thread, so
    the command unwinds (the planner worker stopped, process groups destroyed, a save cut
    short left as a ``.tmp``) to the one line the CLI prints. A second Ctrl-C within
    `GRACE_S` would cut that unwinding short (a traceback, exit -2): it is ignored. A later
    one raises again, in case the first was swallowed (raised inside a finalizer). Once the
    command has stopped (`done`), and after `uninstall` once a signal came, every signal is
    ignored, interpreter exit included.
    """

    GRACE_S = 5.0
    """Seconds after the first signal during which more are ignored; unwinding takes < 1 s."""

    def __init__(self) -> None:
        self.since: float | None = None  # monotonic time of the first signal
        self.done = False
        self._previous: dict[int, object] = {}

    @classmethod
    def current(cls) -> StopSignals | None:
        """The instance whose handler SIGINT has now, if any."""
        owner = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
        return owner if isinstance(owner, cls) else None

    def install(self) -> None:
        """Handle SIGINT and SIGTERM here (main thread only: Python's rule for handlers)."""
        if threading.current_thread() is threading.main_thread():
            for signum in _STOPS:
                self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        """Give the signals back as they were, or ignore them for good once one came."""
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if self.since is not None else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.done or self.since is not None and now - self.since < self.GRACE_S:
            return
        self.since = now
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
