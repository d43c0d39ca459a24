"""CUDA graphs of a one-process training microbatch: forward, loss and backward in one replay.

On a small model the host is the floor: a Llama-3.2-1B microbatch of ~4.5k tokens costs ~536
Triton launches and ~70,000 Python calls, ~110 ms of host time for ~55 ms of GPU work
(docs/throughput.md, issue 33). A CUDA graph records the launches of one microbatch once and
replays them with one call.

A graph fixes every shape and every device address it reads, so a microbatch is replayed only
by the graph of its shape: ``(tokens of each adapter, sample bucket, dropout seed)``. The
runner pads ``T`` to a multiple of `validation.GRAPH_PAD_TOKENS` (`pack_microbatch`'s
loss-free padding sample), and a graph's sample boundaries hold `sample_bucket` samples, the
ones past the microbatch's empty (every layer handles a sample of no tokens), so one
adapter's microbatches fall into a few shapes whatever their sample counts. A shape runs
eagerly until its `CAPTURE_AT`-th microbatch (the first compiles its Triton kernels and fills
its layout's tables), is captured then (after that microbatch ran eagerly: capturing runs
nothing) and is replayed from then on, its tokens, labels, sample boundaries, dropout keys
and loss denominators copied into the graph's own input tensors first. Microbatches whose
shape never repeats (many adapters) stay eager; after 8 captures that were replayed less
than twice each on average, no more are made, and after `GIVE_UP_AFTER` microbatches with
no capture the graphs step aside (`active`): the runner trains eagerly and the session packs
without the padding.

What a replay reads must stay where the capture found it, and hold what it would hold in an
eager run: the LoRA tables (``weights`` and ``grads`` are updated in place), the frozen base,
and the per-adapter scale and dropout vectors (`ops.device_params`; each graph keeps those
alive). A graph is valid while the adapters in the table are the ones it was captured with:
`clear` drops every graph when an adapter is bound to a row. All graphs share one memory
pool (they run one at a time; only their loss outputs outlive a replay).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_lorafusion.ops import AdapterLayout, cached_device_params

logger = logging.getLogger(__name__)

__all__ = ["CAPTURE_AT", "GIVE_UP_AFTER", "MicrobatchGraphs", "sample_bucket"]

CAPTURE_AT = 3
"""A shape is captured at its third microbatch: a capture costs at least an eager run of the
host (with the GPU idle) and a replay saves about half of one (1B, one adapter, H200), so a
capture must be replayed a few times to pay; a shape seen twice is likely to come again.
At global batch 8 it replayed 203 of 256 microbatches at 69.4k tokens/s; capturing at the
second (with `torch.cuda.graph`, which empties the caches) replayed 217 at 64.5k
(docs/throughput.md)."""


GIVE_UP_AFTER = 32
"""Microbatches after which graphs that captured nothing step aside. One adapter's shapes
repeat from its ~5th-9th microbatch on (Llama-3.2-1B workload, global batches 8-32); two or
more adapters' shapes almost never do (`scripts.graph_shapes`). Their eager runs through the
graphs (padded, on a side stream) ran 0.89-0.94x the plain runner's at 4 adapters and global
batch 8 (seventeenth session), so a run whose shapes do not repeat drops them."""


def sample_bucket(samples: int) -> int:
    """Samples a graph's boundaries hold for a microbatch of ``samples``: 16, 32, 64, ..."""
    return max(16, 1 << (samples - 1).bit_length())


@dataclass
class _Graph:
    """One captured shape: the graph, its input tensors and its loss output."""

    graph: torch.cuda.CUDAGraph
    batch: object  # `data.PackedBatch` of the graph's own tensors
    denominators: torch.Tensor  # (A,) fp32
    losses: torch.Tensor  # (A,) fp32, written by each replay
    kept: list[torch.Tensor]  # the per-adapter vectors it may read, past their cache

    def load(self, batch, denominators: torch.Tensor) -> None:
        """Copy a microbatch of this shape into the graph's inputs (device to device)."""
        static = self.batch
        for name in ("input_ids", "position_ids", "labels", "loss_mask"):
            getattr(static, name).copy_(getattr(batch, name), non_blocking=True)
        bounds, given = static.layout.cu_seqlens, batch.layout.cu_seqlens
        bounds[: given.numel()].copy_(given, non_blocking=True)
        bounds[given.numel() :].fill_(static.input_ids.numel())  # empty samples at the end
        if static.layout.row_keys is not None:
            static.layout.row_keys.copy_(batch.layout.keys(), non_blocking=True)
        self.denominators.copy_(denominators, non_blocking=True)


class MicrobatchGraphs:
    """Train microbatches through CUDA graphs of their shapes (eagerly until a shape repeats).

    Args:
        loss: ``(batch, denominators) -> (A,)`` fp32 per-adapter loss terms of a microbatch,
            differentiable (the model's forward and the runner's per-adapter loss).
        max_seqlen: the longest sample any microbatch may hold (at least the padding sample):
            the graphs' attention is launched for it, whatever the microbatch's longest.
        before_capture: called before and after each capture (drop caches whose tensors a
            capture must compute itself, e.g. the compute-dtype copy of the LoRA table).
        max_graphs: shapes captured at most; later new shapes run eagerly.
        pad_tokens: microbatches are to be padded to a multiple of this many tokens while the
            graphs are `active` (the session's packing reads it).
    """

    def __init__(
        self,
        loss: Callable[[object, torch.Tensor], torch.Tensor],
        *,
        max_seqlen: int,
        before_capture: Callable[[], None] = lambda: None,
        max_graphs: int = 64,
        pad_tokens: int = 1,
    ):
        self.loss, self.max_seqlen = loss, max_seqlen
        self.before_capture, self.max_graphs = before_capture, max_graphs
        self.pad_tokens = pad_tokens
        self._graphs: dict[tuple, _Graph] = {}
        self._seen: dict[tuple, int] = {}  # shape -> microbatches of it so far
        self._pool = None
        self._stream: torch.cuda.Stream | None = None  # eager runs and captures
        self.replays = 0  # microbatches trained by a replay
        self.captures = 0
        self._eager = 0  # microbatches run eagerly since the last `clear`

    @property
    def active(self) -> bool:
        """Whether microbatches go through the graphs (False: train them eagerly, unpadded).

        True while graphs exist, or until `GIVE_UP_AFTER` eager microbatches captured nothing
        (or a capture failed).
        """
        return bool(self._graphs) or (self.max_graphs > 0 and self._eager < GIVE_UP_AFTER)

    def clear(self) -> None:
        """Drop every graph (an adapter was bound to a row: its scales may have changed)."""
        self._graphs.clear()
        self._seen.clear()
        self._eager = 0

    @staticmethod
    def _shape(layout: AdapterLayout) -> tuple:
        samples = sample_bucket(layout.cu_seqlens.numel() - 1)
        return (tuple(layout.token_counts()), samples, layout.dropout_seed)

    def train(self, batch, denominators: torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward of one microbatch (gradients added into the table).

        Args:
            batch: the microbatch's `PackedBatch`, on the GPU.
            denominators: (A,) fp32 on the GPU, each adapter's loss denominator.

        Returns:
            (A,) fp32 per-adapter loss terms, detached (a graph's output: read it before the
            next call).
        """
        shape = self._shape(batch.layout)
        graph = self._graphs.get(shape)
        if graph is not None:
            graph.load(batch, denominators)
            graph.graph.replay()
            self.replays += 1
            return graph.losses
        self._eager += 1
        seen = self._seen[shape] = self._seen.get(shape, 0) + 1
        capture = seen >= CAPTURE_AT and len(self._graphs) < self.max_graphs
        if self.captures >= 8 and self.replays < 2 * self.captures:
            capture = False  # shapes rarely repeat here (many adapters): stay eager
        with self.side_stream(batch.input_ids.device):
            losses = self.loss(batch, denominators)
            losses.sum().backward()
            if capture and (graph := self._try_capture(batch, denominators)) is not None:
                self._graphs[shape] = graph
        return losses.detach()

    def _try_capture(self, batch, denominators: torch.Tensor) -> _Graph | None:
        """`_capture`, or None (graphs off from now on) when CUDA refuses the capture.

        The microbatch was trained eagerly before: a refused capture loses nothing.
        """
        try:
            return self._capture(batch, denominators)
        except RuntimeError as error:
            logger.warning(
                "CUDA graphs: off, capturing a microbatch failed (training goes on eagerly): %s",
                str(error).splitlines()[0],
            )
            self.max_graphs = 0
            self.before_capture()
            return None

    @contextlib.contextmanager
    def side_stream(self, device: torch.device):
        """Eager runs and captures on one side stream, ordered with the current one.

        A run's warm-up trains there too while graphs are active (`Run.warm_up`): the
        caching allocator keeps its blocks per stream, and the eager runs it warms up for
        run there.

        Autograd records the stream each node ran on and makes the caller's stream wait for
        it at the end of backward: a capture whose nodes met an eager run's stream (the
        default one) would wait on work outside the graph, which CUDA refuses. Warming up
        and capturing on the same side stream keeps every node of a capture on it.
        """
        if device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        caller = torch.cuda.current_stream(device)
        self._stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            caller.wait_stream(self._stream)

    def _capture(self, batch, denominators: torch.Tensor) -> _Graph:
        """Record the microbatch's launches on the graph's own inputs (runs nothing)."""
        layout = batch.layout
        bounds = layout.cu_seqlens.new_full(
            (sample_bucket(layout.cu_seqlens.numel() - 1) + 1,), batch.input_ids.numel()
        )
        bounds[: layout.cu_seqlens.numel()] = layout.cu_seqlens
        static_layout = AdapterLayout(
            seg_offsets=layout.seg_offsets.clone(),
            cu_seqlens=bounds,
            max_seqlen=max(self.max_seqlen, layout.max_seqlen),
            dropout_seed=layout.dropout_seed,
            row_keys=None if layout.row_keys is None else layout.row_keys.clone(),
        )
        # The tables derived from the tokens per adapter (tiles, rows' adapters, present
        # adapters) are the same for every microbatch of the shape: made by the eager run,
        # they are shared, so the capture records no host-to-device copy.
        static_layout._cache.update(layout._cache)
        static = type(batch)(
            batch.input_ids.clone(),
            batch.position_ids.clone(),
            batch.labels.clone(),
            batch.loss_mask.clone(),
            static_layout,
        )
        static_denominators = denominators.clone()
        self.before_capture()
        graph, losses = self._record(static, static_denominators)
        self.before_capture()
        self.captures += 1
        return _Graph(graph, static, static_denominators, losses, cached_device_params())

    def _record(
        self, batch, denominators: torch.Tensor
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """``(graph, its (A,) loss output)`` of forward, loss and backward on these inputs."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # `torch.cuda.graph` without its emptying of the allocators' caches (the eager runs
        # would then allocate afresh); thread_local: the background writer's copies on other
        # threads go on during the capture, so an unsafe call of the backward (autograd's
        # thread) is not caught either: no op of a training microbatch may copy from
        # pageable memory or use the legacy stream. The caller made this the current stream.
        torch.cuda.synchronize()
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        try:
            losses = self.loss(batch, denominators)
            losses.sum().backward()
        finally:
            graph.capture_end()
        return graph, losses.detach()
