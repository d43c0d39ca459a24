"""Execute one stage's multi-adapter 1F1B actions (`schedule.stage_actions`) on real ranks.

The one training engine: each rank of a ``PP × DP`` grid (TP ranks of a stage all do the
same) walks its own action list, and one process is the degenerate grid (``PP = DP = 1``,
`groups.one_stage_groups`: no communication, each adapter steps right after the backward
that finishes its global batch).

Each adapter's loss is the per-token mean over its own global batch: every microbatch adds
``sum(token losses of adapter a) / (trained tokens in a's global batch)`` to the objective
(`_Runner._adapter_loss`), and the adapters finishing at one microbatch step together in one
fused launch (`AdapterOptimizer.step`).

Activations and their gradients go point-to-point over `PipelineGroups`' two explicit
groups; their shapes are never sent: every stage packs the microbatch from the plan itself,
so it knows ``T`` (``(T, 1, H)`` hidden states, THD packing; ``(T / tp, 1, H)``, this TP
rank's rows, under sequence parallelism). Data-parallel replicas run the same microbatch
stream on disjoint samples (`data_parallel_share`); when an adapter's global batch finishes
on a stage, the stage all-reduces (sums) the gradient rows and summed losses of every
adapter finishing there in one bucket over its DP group, asynchronously, and steps them (one
fused launch) just before the next forward that reads one of them (or at the end). Loss
denominators count the whole global batch, so the sum equals a one-process run.

Gradient clipping (and the logged gradient norm) needs each adapter's norm over every stage:
at the step action each stage computes its squared norms (after the DP sum, over its TP
peers) and starts an all-reduce of them over the pipeline's ``norm_group``; every stage
issues these in the same order (its table's step actions, in microbatch order), and steps the
group once the sum is in, at the latest before the next forward that reads one of its
adapters (the bubble lemma leaves ``S - 1`` microbatches of other work in between).

A call drains the pipeline at its end and completes every pending step, so a run may be cut
into consecutive calls (segments, for checkpoints): gradients of a global batch that
straddles the cut stay in the gradient table and its partial loss in
``AdapterRun.pending_loss``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from megatron_lorafusion.ops import HostCopy, copy_to_device
from megatron_lorafusion.pipeline.groups import PipelineGroups
from megatron_lorafusion.pipeline.schedule import (
    Action,
    data_parallel_share,
    lemma_checked,
    stage_actions,
)
from megatron_lorafusion.planner import Microbatch

if TYPE_CHECKING:
    from megatron_lorafusion.data import PackedBatch
    from megatron_lorafusion.mcore import WgradQueue
    from megatron_lorafusion.pipeline.graphs import MicrobatchGraphs

logger = logging.getLogger(__name__)

__all__ = [
    "AdapterOptimizer",
    "AdapterRun",
    "ComputeEvent",
    "StageForward",
    "gpt_stage_forward",
    "run_pipeline",
    "warm_up_stage",
]


@dataclass
class AdapterRun:
    """One adapter's training state in the runner (its optimizer state is the optimizer's).

    Attributes:
        name: adapter name (for logs).
        batch_tokens: trained tokens of each of its global batches (the loss denominators).
        losses: mean loss of each finished global batch, appended by the runner.
        pending_loss: this replica's loss so far in the unfinished global batch (a run cut
            into segments, or resumed, continues it).
    """

    name: str
    batch_tokens: list[int]
    losses: list[float] = field(default_factory=list)
    pending_loss: float = 0.0

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return len(self.losses)


class AdapterOptimizer(Protocol):
    """What the runner needs of the adapters' optimizer (`train.optim.AdapterAdamW`)."""

    def needs_norms(self, adapter_ids: Iterable[int]) -> bool:
        """A step of these adapters reads gradient norms (same answer on every rank)."""

    def squared_norms(self, adapter_ids: Iterable[int]) -> torch.Tensor:
        """(A,) squared gradient norms of these adapters' rows (summed over TP peers)."""

    def step(
        self,
        adapter_ids: Iterable[int],
        *,
        squared_norms: torch.Tensor | None = None,
        losses: torch.Tensor | None = None,
    ) -> tuple[int, ...]:
        """Queue the step of these adapters (rows of the gradient table) and zero their grads.

        ``squared_norms``: (A,) over every stage, when the step reads norms under PP > 1;
        ``losses``: (k,) on the device, the losses they step on (the last stage). An adapter
        whose norm or loss is not finite is not stepped (decided on the device). Returns the
        adapters queued to step (a stopped one only has its gradients dropped).
        """

    def warm_up(self, adapter_ids: Iterable[int], *, losses: torch.Tensor | None) -> None:
        """Launch what `step` launches for these adapters, changing no row and no state.

        ``losses``: (k,) on the device, of the dtype `step`'s will have, or None as there.
        """

    def check(self) -> None:
        """Raise when the last step refused a non-finite loss or norm (names the adapter)."""

    def confirm(self) -> list[tuple[int, str]]:
        """``(adapter, message)`` of each adapter the last step refused; they stop stepping."""

    def lr(self, adapter_id: int) -> float:
        """Learning rate of the adapter's next step."""


StageForward = Callable[["PackedBatch", "torch.Tensor | None"], torch.Tensor]
"""``(batch, input hidden (T, 1, H) or None on stage 0) -> output``: hidden states
``(T, 1, H)`` on a non-last stage, fp32 per-token loss ``(1, T)`` on the last stage. Under
sequence parallelism the hidden states are ``(T / tp, 1, H)``; the loss stays ``(1, T)``."""


@dataclass(frozen=True)
class ComputeEvent:
    """One timed operation of this rank (for simulator calibration).

    Attributes:
        microbatch: plan position (for ``"O"``: the first adapter of the step group).
        kind: ``"F"``, ``"B"`` or ``"O"``.
        start_s: wall-clock start (``time.time()``, comparable across ranks of one host).
        compute_s: time spent computing, waiting on receives excluded.
        end_s: wall-clock end (``time.time()``).
        tokens: tokens this rank computed (0 for ``"O"``).
    """

    microbatch: int
    kind: str
    start_s: float
    compute_s: float
    end_s: float
    tokens: int


@dataclass
class _Stash:
    """What a forward leaves for its backward."""

    input_tensor: torch.Tensor | None
    output: torch.Tensor | None  # hidden (T, 1, H), the scalar loss, or None: trained
    tokens: int
    adapters: tuple[int, ...]
    grad: tuple[dist.Work, torch.Tensor] | None = None  # posted receive of the output's grad


@dataclass
class _PendingStep:
    """One step group: adapters finishing on this stage at one microbatch."""

    adapters: tuple[int, ...]
    rows: torch.Tensor  # (k,) the adapter ids, on the device
    sums: torch.Tensor  # (k,) float64 this replica's loss sums, on the device
    work: dist.Work | None = None
    bucket: torch.Tensor | None = None  # (k·S + k,) gradient rows, then the loss sums
    norms: torch.Tensor | None = None  # (A,) squared gradient norms, summed over the stages
    norm_work: dist.Work | None = None


@dataclass
class _State:
    """Mutable bookkeeping of one `run_pipeline` call."""

    microbatches: dict[int, Microbatch] = field(default_factory=dict)
    stash: dict[int, _Stash] = field(default_factory=dict)
    sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    pending: dict[int, _PendingStep] = field(default_factory=dict)
    # the last step group: its adapters, those that stepped, their losses on the way
    unconfirmed: tuple[tuple[int, ...], tuple[int, ...], HostCopy] | None = None
    loss_sums: torch.Tensor | None = None  # (A,) float64 on the device: each batch so far
    events: list[ComputeEvent] = field(default_factory=list)
    gpu_events: list[tuple] = field(default_factory=list)  # resolved into `events` at the end
    tokens: int = 0  # this rank's forward tokens so far
    # (perf_counter, tokens, tokens/s) at the last step log line
    logged: tuple[float, int, float] | None = None


def _recording(microbatches: Iterable[Microbatch], store: dict[int, Microbatch]):
    for k, mb in enumerate(microbatches):
        store[k] = mb
        yield mb


def _stage_rows(tokens: int, sequence_shards: int) -> int:
    """Token rows of the hidden states a stage passes on: ``T / tp`` under sequence parallelism.

    Raises:
        ValueError: when the microbatch does not split evenly over the shards.
    """
    if tokens % sequence_shards:
        raise ValueError(
            f"a microbatch of {tokens} tokens cannot be split over {sequence_shards} "
            "sequence-parallel ranks; pad it to a multiple (pack_microbatch(pad_to_multiple=tp))"
        )
    return tokens // sequence_shards


class _Runner:
    """One stage's executor; `run_pipeline` is its only caller."""

    def __init__(
        self,
        forward,
        make_batch,
        adapters,
        optimizer,
        grads,
        groups,
        *,
        global_batch_sizes,
        hidden_size,
        activation_dtype,
        device,
        on_step,
        on_refused,
        record_events,
        first_index,
        sequence_shards,
        wgrad_queue,
        log_every,
        graphs,
    ):
        self.forward, self.make_batch = forward, make_batch
        self.graphs = graphs
        self.log_every = log_every
        self.sequence_shards = sequence_shards
        self.wgrad = wgrad_queue
        self.adapters, self.optimizer, self.grads, self.g = adapters, optimizer, grads, groups
        self.gbs, self.hidden = list(global_batch_sizes), hidden_size
        self.dtype, self.device, self.on_step = activation_dtype, torch.device(device), on_step
        self.on_refused = on_refused
        # A global batch begun in an earlier call (segment) continues its loss sum.
        self.state = _State(
            loss_sums=copy_to_device(
                torch.tensor([run.pending_loss for run in adapters], dtype=torch.float64), device
            )
        )
        self.first_index = first_index
        self.t0, self.wall0 = time.perf_counter(), time.time()
        self.record_events = record_events

    def _gpu_mark(self) -> torch.cuda.Event | None:
        """On a GPU with events on: a timing event on the compute stream (after any waits)."""
        if not (self.record_events and self.device.type == "cuda"):
            return None
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def _event(
        self,
        k: int,
        kind: str,
        start: float,
        waited: float,
        tokens: int,
        gpu_start: torch.cuda.Event | None = None,
    ) -> None:
        if not self.record_events:
            return
        # perf_counter for durations, one time.time() offset so ranks share a time axis.
        offset = self.wall0 - self.t0
        k = k if kind == "O" else self.first_index + k
        now = time.perf_counter()
        if gpu_start is not None:  # device time, resolved once the run is done
            self.state.gpu_events.append(
                (k, kind, start + offset, gpu_start, self._gpu_mark(), now + offset, tokens)
            )
            return
        self.state.events.append(
            ComputeEvent(k, kind, start + offset, now - start - waited, now + offset, tokens)
        )

    def _resolve_gpu_events(self) -> None:
        if not self.state.gpu_events:
            return
        torch.cuda.synchronize(self.device)
        for k, kind, start, first, last, end, tokens in self.state.gpu_events:
            compute = first.elapsed_time(last) / 1e3
            self.state.events.append(ComputeEvent(k, kind, start, compute, end, tokens))
        self.state.gpu_events.clear()

    # -- point to point --------------------------------------------------------------------
    def _post_recv(
        self, tokens: int, src: int, group: dist.ProcessGroup
    ) -> tuple[dist.Work, torch.Tensor]:
        # The shape comes from the plan (every stage packs the microbatch itself).
        rows = _stage_rows(tokens, self.sequence_shards)
        buf = torch.empty(rows, 1, self.hidden, dtype=self.dtype, device=self.device)
        return dist.irecv(buf, src=src, group=group), buf

    def _recv(self, tokens: int, src: int, group: dist.ProcessGroup) -> torch.Tensor:
        work, buf = self._post_recv(tokens, src, group)
        self._wait(work)
        return buf

    def _wait(self, work: dist.Work) -> None:
        """Wait for a receive, running deferred weight-gradient passes while it is pending."""
        while self.wgrad is not None and not work.is_completed() and self.wgrad.run_oldest():
            pass
        work.wait()

    def _send(self, tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
        tensor = tensor.detach().contiguous()
        self.state.sends.append((dist.isend(tensor, dst=dst, group=group), tensor))
        # Completed sends release their buffers; at most ~S are in flight in 1F1B.
        self.state.sends = [(w, t) for w, t in self.state.sends if not w.is_completed()]

    # -- actions ---------------------------------------------------------------------------
    def run(self, actions: Iterator[Action]) -> None:
        for action in actions:
            {"F": self._forward, "B": self._backward, "O": self._step}[action.kind](action)
        if self.wgrad is not None:  # gradients of batches that straddle the end
            self.wgrad.run_all()
        while self.state.pending:
            self._finish_step(min(self.state.pending))
        self._confirm_steps()
        for work, _ in self.state.sends:
            work.wait()
        self.state.sends.clear()
        for run, loss in zip(self.adapters, self.state.loss_sums.tolist(), strict=True):
            run.pending_loss = loss  # this replica's part of an unfinished global batch
        self._resolve_gpu_events()

    def _forward(self, action: Action) -> None:
        k = action.microbatch
        mb = self.state.microbatches.pop(k)  # read once: the stream may be endless
        share = data_parallel_share(mb, self.g.dp_rank, self.g.dp_size)
        for a in share.adapters:  # a forward never reads weights from before a due step
            if a in self.state.pending:
                self._finish_step(a)
        if share.is_idle:
            return
        start = time.perf_counter()
        batch = self.make_batch(share, self.first_index + k)
        tokens = batch.layout.num_tokens
        input_tensor = None
        waited = 0.0
        if not self.g.is_first:
            before = time.perf_counter()
            input_tensor = self._recv(tokens, self.g.prev_rank, self.g.forward_group)
            waited = time.perf_counter() - before
            input_tensor.requires_grad_()
        gpu_start = self._gpu_mark()  # the stream waited for the input before this point
        self.state.tokens += share.tokens  # the plan's tokens: padding is not work done
        if self.graphs is not None and self.graphs.active:  # forward, loss, backward at once
            losses = self.graphs.train(batch, self._denominators(share))
            self.state.loss_sums += losses  # read back at steps only: no sync here
            self.state.stash[k] = _Stash(None, None, tokens, share.adapters)
            self._event(k, "F", start, waited, tokens, gpu_start)
            return
        output = self.forward(batch, input_tensor)
        stash = _Stash(input_tensor, output, tokens, share.adapters)
        if self.g.is_last:
            losses = adapter_losses(output, batch, self._denominators(share))
            self.state.loss_sums += losses.detach()  # read back at steps only: no sync here
            stash.output = losses.sum()
        else:
            self._send(output, self.g.next_rank, self.g.forward_group)
            # Post the gradient's receive now, so it can land while this stage computes;
            # posted in forward order = the next stage's backward (send) order.
            stash.grad = self._post_recv(tokens, self.g.next_rank, self.g.backward_group)
        self.state.stash[k] = stash
        self._event(k, "F", start, waited, tokens, gpu_start)

    def _denominators(self, share: Microbatch) -> torch.Tensor:
        """(A,) fp32 on the device: trained tokens of each adapter's current global batch."""
        denominators = [1.0] * len(self.adapters)
        for s in share.samples:
            denominators[s.adapter] = float(
                max(self.adapters[s.adapter].batch_tokens[s.index // self.gbs[s.adapter]], 1)
            )
        return copy_to_device(torch.tensor(denominators), self.device)

    def _backward(self, action: Action) -> None:
        stash = self.state.stash.pop(action.microbatch, None)
        if stash is None:  # idle for this replica
            return
        if stash.output is None:  # trained whole in its forward (`MicrobatchGraphs`)
            return
        start = time.perf_counter()
        waited = 0.0
        if self.g.is_last:
            gpu_start = self._gpu_mark()
            stash.output.backward()
        else:
            before = time.perf_counter()
            work, grad = stash.grad
            self._wait(work)
            waited = time.perf_counter() - before
            gpu_start = self._gpu_mark()
            torch.autograd.backward(stash.output, grad_tensors=grad)
        if not self.g.is_first:
            self._send(stash.input_tensor.grad, self.g.prev_rank, self.g.backward_group)
        if self.wgrad is not None:
            self.wgrad.seal(stash.adapters)
        self._event(action.microbatch, "B", start, waited, stash.tokens, gpu_start)

    def _step(self, action: Action) -> None:
        if self.wgrad is not None:  # the step reads every gradient of its adapters
            self.wgrad.run_for(action.finishes)
        for a in action.finishes:
            if a in self.state.pending:  # no forward of this replica read `a` since its last step
                self._finish_step(a)
        rows = copy_to_device(torch.tensor(action.finishes), self.device)
        group = _PendingStep(
            tuple(action.finishes), rows, self.state.loss_sums.index_select(0, rows)
        )
        self.state.loss_sums.index_fill_(0, rows, 0.0)
        for a in group.adapters:
            self.state.pending[a] = group
        if self.g.dp_size > 1:
            # One bucket per step group: the finishing adapters' gradient rows (zeros where
            # this replica saw none of their tokens) and loss sums, summed while work runs.
            group.bucket = torch.cat(
                [self.grads.index_select(0, rows).reshape(-1), group.sums.to(self.grads.dtype)]
            )
            group.work = dist.all_reduce(group.bucket, group=self.g.dp_group, async_op=True)
        if self.g.num_stages > 1 and self.optimizer.needs_norms(group.adapters):
            self._reduce_norms(group)
        elif self.g.dp_size == 1:
            self._finish_step(group.adapters[0])

    def _reduce_norms(self, group: _PendingStep) -> None:
        """Start the sum over stages of the squared norms (issued here, in step order).

        Issued at once, never when the step is due: a stage that waits for a sum its peer
        has not issued yet, while the peer waits for that stage's activations, would hang.
        Under DP the norms are of the replicas' summed gradients, so the bucket is waited
        for first (DP replicas reach this step at the same action).
        """
        self._receive_bucket(group)
        group.norms = self.optimizer.squared_norms(group.adapters)
        group.norm_work = dist.all_reduce(group.norms, group=self.g.norm_group, async_op=True)

    def _receive_bucket(self, group: _PendingStep) -> None:
        """Wait for a step group's DP sum and copy its gradient rows and loss sums back."""
        if group.work is None:
            return
        group.work.wait()
        group.work = None
        count = len(group.adapters)
        self.grads.index_copy_(0, group.rows, group.bucket[:-count].view(count, -1))
        group.sums = group.bucket[-count:]

    def _finish_step(self, a: int) -> None:
        """Complete the step group holding adapter ``a`` (all its adapters step now).

        The step is queued with no host read (the optimizer gates it on the device); its
        losses come back to the host while the next microbatch runs and are recorded, checked
        and logged by `_confirm_steps`, before the next step group and at the end of the call.
        """
        group = self.state.pending[a]
        for b in group.adapters:
            del self.state.pending[b]
        self._confirm_steps()
        start = time.perf_counter()
        gpu_start = self._gpu_mark()
        self._receive_bucket(group)
        if group.norm_work is not None:
            group.norm_work.wait()
        stepped = self.optimizer.step(
            group.adapters,
            squared_norms=group.norms,
            losses=group.sums if self.g.is_last else None,
        )
        self._event(group.adapters[0], "O", start, 0.0, 0, gpu_start)
        # Stopped adapters (early stopping, a failure) only dropped their gradients: their
        # losses are not recorded.
        self.state.unconfirmed = (group.adapters, stepped, HostCopy(group.sums))

    def _confirm_steps(self) -> None:
        """Record, check and log the losses of the step queued last (one step group at most).

        An adapter the step refused (a NaN or infinite loss or norm) is not recorded: it is
        reported to ``on_refused`` and steps no more, while the others of its group go on;
        without ``on_refused`` the run stops with the optimizer's error.
        """
        if self.state.unconfirmed is None:
            return
        (adapters, stepped, sums), self.state.unconfirmed = self.state.unconfirmed, None
        losses = sums.tolist()
        refused = dict(self.optimizer.confirm())
        if refused and self.on_refused is None:
            raise RuntimeError(next(iter(refused.values())))
        rate = None
        for b, loss in zip(adapters, losses, strict=True):
            if b in refused:
                self.on_refused(b, refused[b])
                continue
            if b not in stepped:
                continue
            run = self.adapters[b]
            # Only the last stage computes losses; others record NaN until `_share_losses`.
            run.losses.append(loss if self.g.is_last else float("nan"))
            if self.g.is_last and self.g.dp_rank == 0 and run.step % self.log_every == 0:
                rate = self._tokens_per_s() if rate is None else rate
                logger.info(
                    "adapter %s step %d | loss %.4f | lr %.1e | %.1fk tok/s",
                    run.name,
                    run.step,
                    run.losses[-1],
                    self.optimizer.lr(b),
                    rate / 1e3,
                )
            if self.on_step is not None:
                self.on_step(b, run)

    def _tokens_per_s(self) -> float:
        """Run-wide tokens/s since the last step log line (this replica's times DP).

        Steps confirmed together at the end of a call saw no forward since the last line:
        they report that line's rate.
        """
        now = time.perf_counter()
        since, tokens, rate = self.state.logged or (self.t0, 0, 0.0)
        if self.state.tokens > tokens:
            rate = (self.state.tokens - tokens) * self.g.dp_size / max(now - since, 1e-9)
            self.state.logged = (now, self.state.tokens, rate)
        return rate


def adapter_losses(
    token_loss: torch.Tensor, batch: PackedBatch, denominators: torch.Tensor
) -> torch.Tensor:
    """(A,) each adapter's token-loss sum over its rows / its global batch's trained tokens.

    ``token_loss``: (1, T) fp32; ``denominators``: (A,) fp32 on its device. The objective of a
    microbatch is the sum of the terms (each adapter's loss is the per-token mean over its
    own global batch).
    """
    token_loss = token_loss * batch.loss_mask  # (1, T)
    rows = batch.layout.row_adapter(token_loss.device)
    per_adapter = torch.zeros(
        denominators.numel(), dtype=torch.float32, device=token_loss.device
    ).index_add_(0, rows, token_loss[0].float())
    return per_adapter / denominators


def _share_losses(adapters: Sequence[AdapterRun], groups: PipelineGroups) -> None:
    """Copy every adapter's step losses from the last stage to the other stages."""
    if groups.num_stages == 1:
        return
    payload = [[run.losses for run in adapters]]
    dist.broadcast_object_list(payload, src=groups.last_rank, group=groups.forward_group)
    for run, losses in zip(adapters, payload[0], strict=True):
        run.losses[:] = losses


def run_pipeline(
    microbatches: Iterable[Microbatch],
    forward: StageForward,
    make_batch: Callable[[Microbatch, int], PackedBatch],
    adapters: Sequence[AdapterRun],
    optimizer: AdapterOptimizer,
    grads: torch.Tensor,
    groups: PipelineGroups,
    *,
    global_batch_sizes: Sequence[int],
    hidden_size: int,
    activation_dtype: torch.dtype,
    device: torch.device | str,
    on_step: Callable[[int, AdapterRun], None] | None = None,
    on_refused: Callable[[int, str], None] | None = None,
    record_events: bool = False,
    first_index: int = 0,
    sequence_shards: int = 1,
    wgrad_queue: WgradQueue | None = None,
    log_every: int = 1,
    graphs: MicrobatchGraphs | None = None,
) -> list[ComputeEvent]:
    """Train this rank's stage through a stream of planned microbatches (no flush).

    Every rank of the job calls it with the same stream. The stream is checked against the
    bubble lemma as it is scheduled (`schedule.lemma_checked`, ``S + 1`` microbatches ahead):
    every rank raises at the same microbatch, before its forward.

    Args:
        microbatches: the plan's microbatches in order (idle ones included).
        forward: this stage's model forward (see `StageForward`).
        make_batch: packs a microbatch (this replica's share) and its plan position.
        adapters: per adapter id, its losses and loss denominators (the trained tokens of
            each whole global batch, all replicas together).
        optimizer: steps the adapters (`train.optim.AdapterAdamW` over this rank's factors).
        grads: (A, S) this rank's gradient table (`LoRAContext.grads`), row ``a`` adapter
            ``a``'s: the rows of a step group are all-reduced over the DP group.
        groups: this rank's pipeline and data-parallel groups.
        global_batch_sizes: per adapter, samples per global batch (finds a sample's batch).
        hidden_size: ``H`` of the activations passed between stages.
        activation_dtype: dtype of those activations (the model's compute dtype).
        device: where receive buffers live (the model's device).
        on_step: called on every rank once adapter ``a``'s step is confirmed (its loss on the
            host: at the next step group or the end of the call), with ``(a, run)``.
        on_refused: called with ``(a, message)`` when adapter ``a``'s step was refused (a
            NaN or infinite loss or gradient norm): it steps no more, the others go on. None:
            the call raises instead.
        record_events: time every operation (the calibration study, docs/pipeline.md); on a GPU
            compute times are CUDA-event times on the compute stream, from after the
            operation's receive to its end (no host synchronisation).
        first_index: plan position of the stream's first microbatch (a segment of a run
            cut for checkpoints); ``make_batch`` and events get plan positions.
        sequence_shards: the TP size under sequence parallelism, else 1: the activations
            passed between stages hold ``T / sequence_shards`` token rows.
        wgrad_queue: the `LoRAContext`'s queue when LoRA weight gradients are deferred
            (``parallel.defer_wgrad``): run while this stage waits for a peer, before the
            optimizer steps of the adapters a pass touched, and at the end of the call.
        log_every: log an adapter's loss every this many of its steps (last stage, DP rank 0).
        graphs: train each microbatch through `MicrobatchGraphs` (one process only: one
            stage, one replica, weight gradients not deferred); None: eagerly.

    Returns:
        This rank's timed operations in execution order (empty unless ``record_events``).

    Raises:
        LemmaError: when the stream breaks the bubble lemma.
        RuntimeError: on a communication failure or timeout (a dead peer).
    """
    one_process = groups.num_stages == 1 and groups.dp_size == 1 and sequence_shards == 1
    if graphs is not None and not (one_process and wgrad_queue is None):
        raise ValueError(
            "CUDA graphs train one process only (one pipeline stage, one data-parallel "
            f"replica, no sequence parallelism, weight gradients not deferred), got "
            f"{groups.num_stages} stages, {groups.dp_size} replicas, {sequence_shards} "
            f"sequence shards, deferred weight gradients {wgrad_queue is not None}"
        )
    runner = _Runner(
        forward,
        make_batch,
        adapters,
        optimizer,
        grads,
        groups,
        global_batch_sizes=global_batch_sizes,
        hidden_size=hidden_size,
        activation_dtype=activation_dtype,
        device=device,
        on_step=on_step,
        on_refused=on_refused,
        record_events=record_events,
        first_index=first_index,
        sequence_shards=sequence_shards,
        wgrad_queue=wgrad_queue,
        log_every=log_every,
        graphs=graphs,
    )
    # Stage 0's rule, the strictest, on every rank: all refuse at the same microbatch.
    stream = _recording(lemma_checked(microbatches, groups.num_stages), runner.state.microbatches)
    actions = stage_actions(groups.stage, groups.num_stages, stream)
    try:
        runner.run(actions)
    except BaseException:
        # Drop in-flight work now: a gloo send still referenced once its group is destroyed
        # holds the process at exit until the group timeout, delaying its peers' errors.
        runner.state.sends.clear()
        runner.state.pending.clear()
        runner.state.unconfirmed = None
        runner.state.stash.clear()  # and posted receives
        if wgrad_queue is not None:
            wgrad_queue.clear()
        raise
    _share_losses(adapters, groups)
    return runner.state.events


def warm_up_stage(
    microbatch: Microbatch,
    forward: StageForward,
    make_batch: Callable[[Microbatch, int], PackedBatch],
    optimizer: AdapterOptimizer,
    grads: torch.Tensor,
    groups: PipelineGroups,
    *,
    hidden_size: int,
    activation_dtype: torch.dtype,
    device: torch.device | str,
    sequence_shards: int = 1,
    wgrad_queue: WgradQueue | None = None,
) -> bool:
    """Train this replica's share of ``microbatch`` once and forget it: a run's one-off costs.

    A process's first microbatch pays once for what later ones reuse: kernels loaded from
    Triton's cache, CUDA modules torch loads lazily, cuBLAS's set-up, the allocator's and the
    pinned pools' first blocks. This pays them before training, on the first microbatch of
    the plan (the shapes training starts with; ``make_batch`` gets plan position 0). No peer
    is involved: a later stage gets zeros for its input and an earlier one zeros for its
    output's gradient, so each rank warms up on its own (TP ranks of a stage together, as
    they run the same collectives). Nothing it learned stays: the whole gradient table is
    zeroed after it, even when it fails (so it must hold nothing before: a run's start),
    and the optimizer launches a step that changes no row (`AdapterAdamW.warm_up`). The
    LoRA context keeps the microbatch's layout and the model its zero input tensor, both
    replaced by the next forward.

    Returns:
        Whether it ran (False when this replica's share of ``microbatch`` is empty).
    """
    share = data_parallel_share(microbatch, groups.dp_rank, groups.dp_size)
    if share.is_idle:
        return False
    device = torch.device(device)
    batch = make_batch(share, 0)
    rows = _stage_rows(batch.layout.num_tokens, sequence_shards)
    try:
        input_tensor = None
        if not groups.is_first:
            input_tensor = torch.zeros(
                rows,
                1,
                hidden_size,
                dtype=activation_dtype,
                device=device,
                requires_grad=True,
            )
        output = forward(batch, input_tensor)
        if groups.is_last:
            denominators = torch.ones(grads.shape[0], device=device)
            adapter_losses(output, batch, denominators).sum().backward()
        else:
            torch.autograd.backward(output, grad_tensors=torch.zeros_like(output))
        if wgrad_queue is not None:
            wgrad_queue.seal(share.adapters)
            wgrad_queue.run_all()
    except BaseException:
        if wgrad_queue is not None:
            wgrad_queue.clear()
        raise
    finally:
        grads.zero_()
    # The loss sums a step reads: the runner's fp64 sums in one replica, the DP bucket's dtype.
    loss_dtype = torch.float64 if groups.dp_size == 1 else grads.dtype
    losses = torch.zeros(len(share.adapters), dtype=loss_dtype, device=device)
    optimizer.warm_up(share.adapters, losses=losses if groups.is_last else None)
    return True


def gpt_stage_forward(
    model: torch.nn.Module, lora, *, is_first: bool, is_last: bool
) -> StageForward:
    """`StageForward` of one pipeline stage of a Megatron `GPTModel` with LoRA applied.

    Args:
        model: this stage's `GPTModel` (``pre_process = is_first``, ``post_process = is_last``).
        lora: its `LoRAContext` (the layout is set before each forward).
        is_first: this is stage 0 (embeds ``input_ids``).
        is_last: this is the last stage (returns the per-token loss of ``labels``).
    """
    from megatron_lorafusion.mcore.parallel import packed_seq_params

    def forward(batch: PackedBatch, input_tensor: torch.Tensor | None) -> torch.Tensor:
        lora.layout = batch.layout
        model.set_input_tensor(input_tensor)
        out = model(
            batch.input_ids if is_first else None,
            batch.position_ids if is_first else None,
            None,
            labels=batch.labels if is_last else None,
            packed_seq_params=packed_seq_params(batch.layout),
        )
        return out.float() if is_last else out

    return forward
