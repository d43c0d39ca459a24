"""Plans made ahead of training in a worker process, chunk by chunk, through a bounded queue.

The worker runs `iter_plan_chunks` (same chunks, same order, so the result is deterministic
for a problem and seed) and blocks when ``max_chunks_ahead`` chunks wait unread. The stream
is chosen for the whole run before its first chunk (2.3-2.6 s per 100,000 samples with
greedy); from then on the worker is ahead of the GPU. A worker that raises or dies
surfaces in the training process as `PlannerWorkerError` on the next read. A worker never
outlives its parent, however the parent dies (SIGKILL included): on Linux the kernel kills it
(``PR_SET_PDEATHSIG``), and everywhere it checks its parent whenever a full queue makes it
wait. It ignores Ctrl-C, which the terminal sends to its whole process group: the parent
stops it (`lifetime.ignore_ctrl_c`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import traceback
import weakref
from collections.abc import Iterator
from typing import Literal

from megatron_lorafusion.lifetime import (
    die_with_parent,
    ignore_ctrl_c,
    parent_alive,
    started_deaf,
)
from megatron_lorafusion.planner.cost import CostModel
from megatron_lorafusion.planner.plan import DEFAULT_SOLVER, DEFAULT_TIME_LIMIT_S, iter_plan_chunks
from megatron_lorafusion.planner.types import Plan, PlanProblem

__all__ = ["BackgroundPlanner", "PlannerWorkerError"]

logger = logging.getLogger(__name__)

_DONE = "done"
_ERROR = "error"
_CHUNK = "chunk"
_SIGNALS = {int(s) for s in signal.Signals}


class PlannerWorkerError(RuntimeError):
    """The background planner's worker process raised or died; the message says how."""


def _put(out: mp.Queue, message: tuple, parent_pid: int, poll_s: float) -> None:
    """``out.put(message)``, checking every ``poll_s`` seconds that the parent still lives."""
    while True:
        try:
            out.put(message, timeout=poll_s)
            return
        except queue.Full:
            if not parent_alive(parent_pid):  # nobody will read: end without cleanup
                os._exit(1)


def _produce(job: bytes, out: mp.Queue, parent_pid: int, poll_s: float) -> None:
    """Worker body: put ``(kind, payload)`` messages; errors travel as formatted tracebacks.

    ``job`` is the pickled ``(problem, rounds_per_chunk, solver, time_limit_s, cost)``, read
    here so that a failure to rebuild it reaches the parent too (unpickled by the spawn
    bootstrap, it would only end the worker with exit code 1).
    """
    try:
        ignore_ctrl_c()  # the parent gets the terminal's Ctrl-C too, and stops us
        die_with_parent(parent_pid)
        problem, rounds_per_chunk, solver, time_limit_s, cost = pickle.loads(job)
        chunks = iter_plan_chunks(problem, rounds_per_chunk, solver, time_limit_s, cost=cost)
        for chunk in chunks:
            _put(out, (_CHUNK, chunk), parent_pid, poll_s)
        _put(out, (_DONE, None), parent_pid, poll_s)
    except BaseException:  # the parent must see every failure, then we exit
        _put(out, (_ERROR, traceback.format_exc()), parent_pid, poll_s)


def _kill(process: mp.Process) -> None:
    if process.is_alive():
        process.kill()


class BackgroundPlanner:
    """Iterate over plan chunks computed by a worker process.

    Use as a context manager (or call `close`), and iterate: each item is a `Plan` holding
    the next microbatches of the stream; their concatenation is a verified plan of
    ``problem`` identical to ``list(iter_plan_chunks(problem, rounds_per_chunk, ...))``.

    Args:
        problem: the whole problem.
        rounds_per_chunk: rounds (one global batch per active adapter) per chunk.
        solver: ``"greedy"`` or ``"milp"``.
        time_limit_s: wall-clock safety limit of each MILP solve, in seconds.
        max_chunks_ahead: queue bound: chunks the worker may compute before they are read.
        start_method: multiprocessing start method; ``"spawn"`` is safe after CUDA and NCCL
            are initialised in the parent.
        poll_s: seconds between liveness checks of the worker while waiting for a chunk, and
            of the parent while the worker waits for room in the queue.
        cost: cost model for the packed / round-robin choice (default `CostModel()`).

    Raises:
        PlannerWorkerError: from iteration, if the worker raised (its traceback is in the
            message) or exited without finishing.
    """

    def __init__(
        self,
        problem: PlanProblem,
        rounds_per_chunk: int = 4,
        solver: Literal["milp", "greedy"] = DEFAULT_SOLVER,
        time_limit_s: float = DEFAULT_TIME_LIMIT_S,
        max_chunks_ahead: int = 2,
        start_method: str = "spawn",
        poll_s: float = 1.0,
        *,
        cost: CostModel | None = None,
    ) -> None:
        if max_chunks_ahead < 1:
            raise ValueError(f"max_chunks_ahead must be >= 1, got {max_chunks_ahead}")
        if rounds_per_chunk < 1:
            raise ValueError(f"rounds_per_chunk must be >= 1, got {rounds_per_chunk}")
        if solver not in ("milp", "greedy"):
            raise ValueError(f"solver must be 'milp' or 'greedy', got {solver!r}")
        ctx = mp.get_context(start_method)
        self._queue = ctx.Queue(maxsize=max_chunks_ahead)
        self._poll_s = poll_s
        self._done = False
        self._process = ctx.Process(
            target=_produce,
            args=(
                pickle.dumps((problem, rounds_per_chunk, solver, time_limit_s, cost)),
                self._queue,
                os.getpid(),
                poll_s,
            ),
            name="lorafusion-planner",
            daemon=True,
        )
        # Dropped unclosed (Ctrl-C raised right after the start): its queue's semaphores go,
        # and a worker still unpickling them would print a traceback; SIGKILL ends it first.
        weakref.finalize(self, _kill, self._process)
        with started_deaf():  # a Ctrl-C while the worker's interpreter starts stays pending
            self._process.start()

    @property
    def pid(self) -> int | None:
        """Process id of the worker."""
        return self._process.pid

    def __iter__(self) -> Iterator[Plan]:
        return self

    def __next__(self) -> Plan:
        if self._done:
            raise StopIteration
        while True:
            try:
                kind, payload = self._queue.get(timeout=self._poll_s)
                break
            except queue.Empty:
                if not self._process.is_alive():
                    try:  # what it sent just before exiting (its traceback) comes first
                        kind, payload = self._queue.get(timeout=self._poll_s)
                        break
                    except queue.Empty:
                        pass
                    self._done = True
                    code = self._process.exitcode
                    how = (
                        f" (killed by {signal.Signals(-code).name})"
                        if code is not None and code < 0 and -code in _SIGNALS
                        else ""
                    )
                    raise PlannerWorkerError(
                        f"planner worker (pid {self._process.pid}) exited with code "
                        f"{code}{how} before finishing the plan, sending no error"
                    ) from None
            except (EOFError, OSError, pickle.UnpicklingError) as e:
                # A worker killed in the middle of a write leaves a truncated message.
                self._done = True
                raise PlannerWorkerError(
                    f"planner worker (pid {self._process.pid}) sent a broken message ({e!r}); "
                    f"exit code {self._process.exitcode}"
                ) from e
        if kind == _CHUNK:
            return payload
        self._done = True
        self.close()
        if kind == _ERROR:
            raise PlannerWorkerError(f"planner worker failed:\n{payload}")
        raise StopIteration

    def close(self) -> None:
        """Stop the worker (if still running) and release the queue."""
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(timeout=10)
        self._queue.close()

    def __enter__(self) -> BackgroundPlanner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
