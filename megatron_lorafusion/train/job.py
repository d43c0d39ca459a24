"""`AdapterJob`: one adapter's life, from its data to its export.

A job owns what makes its training its own (DESIGN.md "Every adapter on its own"): its rows
in a training order seeded by ``(train.seed, its name)``, its eval rows, its loss
denominators, its step and LR-schedule position (the optimizer's row), its evaluations and
early-stopping state, and its status: ``queued`` → ``running`` → ``done`` (all its steps),
``stopped`` (early stopping), ``cancelled`` (asked to) or ``failed`` (diverged, or the server
could not take it). Its dropout keys are ``(train.seed, its name, sample position)``, so
which microbatch a sample lands in never changes what the adapter learns.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field

from megatron_lorafusion.config import AdapterConfig
from megatron_lorafusion.data import TokenizedSample
from megatron_lorafusion.inbox import FINISHED
from megatron_lorafusion.pipeline import AdapterRun

__all__ = ["FINISHED", "AdapterJob", "batch_token_counts", "sample_key"]


def sample_key(seed: int, name: str, position: int) -> int:
    """Dropout key of sample ``position`` of adapter ``name`` (64 bits of a hash, ``< 2**62``).

    Row ``i`` of the sample is keyed ``key + i`` (`ops.AdapterLayout.row_keys`).
    """
    digest = hashlib.blake2b(f"{seed}/{name}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**62)


def batch_token_counts(
    rows: list[TokenizedSample], order: list[int], global_batch_size: int
) -> list[int]:
    """Trained (loss) tokens of each global batch of ``order``: the loss denominators."""
    counts = []
    for start in range(0, len(order), global_batch_size):
        batch = order[start : start + global_batch_size]
        counts.append(sum(sum(rows[i].loss_mask) for i in batch))
    return counts


@dataclass
class AdapterJob:
    """One adapter's training: data, cursor, evaluations and status.

    Attributes:
        config: the adapter.
        rows: its tokenised training rows.
        held: its eval rows (empty: it is never evaluated).
        order: dataset row of each training position (epochs concatenated, shuffled).
        run: the runner's view (losses of each step, partial loss of the batch in flight).
        seed: ``train.seed``.
        status: see the module docstring.
        slot: the row of the adapter tables it trains in while running, else None.
        evals: ``(step, eval loss)`` of each evaluation so far.
        best: ``(step, eval loss)`` of the best evaluation, None before the first.
        bad: evaluations since the best.
        reason: why it failed or stopped.
        saved_step: step of its newest complete checkpoint (0: none).
    """

    config: AdapterConfig
    rows: list[TokenizedSample]
    held: list[TokenizedSample]
    order: list[int]
    run: AdapterRun
    seed: int
    status: str = "queued"
    slot: int | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)
    best: tuple[int, float] | None = None
    bad: int = 0
    reason: str = ""
    saved_step: int = 0

    @classmethod
    def create(
        cls,
        config: AdapterConfig,
        rows: list[TokenizedSample],
        held: list[TokenizedSample],
        order: list[int],
        seed: int,
    ) -> AdapterJob:
        """A queued job over ``order`` (its loss denominators computed here)."""
        run = AdapterRun(config.name, batch_token_counts(rows, order, config.global_batch_size))
        return cls(config, rows, held, order, run, seed)

    @property
    def name(self) -> str:
        """The adapter's name (its identity: seeds, files)."""
        return self.config.name

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step."""
        return self.config.global_batch_size

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        return self.run.step

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole job."""
        return len(self.run.batch_tokens)

    @property
    def finished(self) -> bool:
        """The job will not train again (done, stopped, cancelled or failed)."""
        return self.status in FINISHED

    def sample_key(self, position: int) -> int:
        """Dropout key of training position ``position`` (`sample_key`)."""
        return sample_key(self.seed, self.name, position)

    def sample_tokens(self, position: int) -> int:
        """Tokens of the sample at training position ``position``."""
        return len(self.rows[self.order[position]])

    def eval_due(self, step: int, eval_every: int) -> bool:
        """The job is evaluated after its step ``step`` (every ``eval_every``, and at its last)."""
        if eval_every <= 0 or not self.held:
            return False
        return step % eval_every == 0 or step == self.total_steps

    def record_eval(self, step: int, loss: float) -> bool:
        """Add an evaluation; returns True when it is a new best (it then becomes ``best``).

        With ``early_stopping_patience`` p > 0, the job's status becomes ``stopped`` after p
        evaluations without a new best.
        """
        self.evals.append((step, loss))
        if self.best is None or loss < self.best[1]:
            self.best, self.bad = (step, loss), 0
            return True
        self.bad += 1
        patience = self.config.early_stopping_patience
        if patience > 0 and self.bad >= patience:
            self.status = "stopped"
            self.reason = (
                f"early stop at step {step}: {self.bad} evaluations without improving on "
                f"{self.best[1]:.4f} at step {self.best[0]}"
            )
        return False

    def export_step(self) -> int | None:
        """The step whose weights are exported: the best evaluated under early stopping."""
        if self.config.early_stopping_patience > 0 and self.best is not None:
            return self.best[0]
        return None

    def state(self) -> dict:
        """JSON-able state of the job at its current step (a checkpoint's ``job`` entry)."""
        return {
            "step": self.step,
            "samples": self.step * self.global_batch_size,
            "losses": [_json_float(x) for x in self.run.losses],
            "evals": [[s, _json_float(x)] for s, x in self.evals],
            "best": None if self.best is None else [self.best[0], self.best[1]],
            "bad": self.bad,
            "status": self.status,
            "reason": self.reason,
        }

    def restore(self, state: dict) -> None:
        """Take the state `state` gave (a resumed job; its rows and order are rebuilt).

        A checkpoint taken where the job stopped early or was cancelled keeps that status:
        the job trains no more, its export is what is left (a kill came before it).
        """
        if state.get("status") in ("stopped", "cancelled"):
            self.status, self.reason = state["status"], state.get("reason")
        self.run.losses[:] = [math.nan if x is None else float(x) for x in state["losses"]]
        self.run.pending_loss = 0.0
        self.evals = [(int(s), float(x)) for s, x in state["evals"]]
        self.best = None if state["best"] is None else (int(state["best"][0]), state["best"][1])
        self.bad = int(state["bad"])
        self.saved_step = int(state["step"])

    def identity(self) -> dict:
        """The adapter's config as a checkpoint records it (a changed key refuses a resume)."""
        return asdict(self.config)


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None
