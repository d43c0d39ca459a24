"""Processes that never outlive the process that started them.

A planner worker whose trainer was killed, or a torchrun rank whose launcher was, would
otherwise run on (blocked on a queue or a collective), holding memory and a GPU. On Linux
the kernel kills such a process when its parent dies (``PR_SET_PDEATHSIG``); elsewhere
callers that wait check `parent_alive` in their loop. No other package imports here: every
layer may use it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent", "parent_alive"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
