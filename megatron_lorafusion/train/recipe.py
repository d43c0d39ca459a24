"""The one wiring of a training run: groups -> model -> LoRA -> optimizer -> the runner.

`build_run` is what `train.main`, the pipeline tests and the benchmarks build a run with; the
samples stay the caller's (a `make_batch` per `Run.train` call), since a job reads datasets,
a test draws random rows and a benchmark pads them as a baseline does. Megatron's parallel
state must be initialised first (`mcore.parallel.init_model_parallel`); one process is the
``PP = DP = 1`` case of the same runner (`pipeline.one_stage_groups`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from megatron_lorafusion.config import AdapterConfig, ModelConfig
from megatron_lorafusion.pipeline import (
    AdapterRun,
    ComputeEvent,
    MicrobatchGraphs,
    PipelineGroups,
    StageForward,
    adapter_losses,
    gpt_stage_forward,
    run_pipeline,
    warm_up_stage,
)
from megatron_lorafusion.planner import Microbatch
from megatron_lorafusion.train.optim import AdapterAdamW, tensor_parallel_squared_norms
from megatron_lorafusion.validation import GRAPH_PAD_TOKENS

__all__ = ["Run", "adapter_training", "build_run", "graphs_apply", "pipeline_groups"]


@dataclass
class Run:
    """This rank's part of a training run, ready for `train`.

    Attributes:
        model: this stage's `GPTModel` (frozen base, LoRA applied).
        lora: its `LoRAContext`.
        optimizer: the adapters' `AdapterAdamW` over this rank's factors.
        runs: per adapter id, its `AdapterRun` (losses, loss denominators).
        groups: this rank's `PipelineGroups`.
        forward: this stage's `StageForward`.
        global_batch_sizes: per adapter, samples per global batch.
        activation_dtype: dtype of the activations passed between stages.
        device: where the model lives.
        sequence_shards: TP size under sequence parallelism, else 1.
        graphs: the `MicrobatchGraphs` each microbatch trains through, or None (eagerly).
    """

    model: torch.nn.Module
    lora: object
    optimizer: AdapterAdamW
    runs: list[AdapterRun]
    groups: PipelineGroups
    forward: StageForward
    global_batch_sizes: list[int]
    activation_dtype: torch.dtype
    device: torch.device
    sequence_shards: int
    graphs: MicrobatchGraphs | None = None

    def train(
        self,
        microbatches: Iterable[Microbatch],
        make_batch: Callable,
        *,
        first_index: int = 0,
        on_step: Callable[[int, AdapterRun], None] | None = None,
        on_refused: Callable[[int, str], None] | None = None,
        log_every: int = 1,
        record_events: bool = False,
    ) -> list[ComputeEvent]:
        """`pipeline.run_pipeline` of ``microbatches`` on this rank (drained at the end).

        Args:
            microbatches: the plan's microbatches in order (a segment of it).
            make_batch: packs a microbatch (this replica's share) and its plan position.
            first_index: plan position of the first microbatch.
            on_step: called after adapter ``a`` steps, with ``(a, run)``.
            on_refused: called with ``(a, message)`` when adapter ``a``'s step was refused (a
                NaN or infinite loss or norm); None: the call raises.
            log_every: log an adapter's loss every this many of its steps.
            record_events: time every operation (`ComputeEvent`).

        Returns:
            This rank's timed operations (empty unless ``record_events``).
        """
        return run_pipeline(
            microbatches,
            self.forward,
            make_batch,
            self.runs,
            self.optimizer,
            self.lora.grads,
            self.groups,
            global_batch_sizes=self.global_batch_sizes,
            hidden_size=self.model.config.hidden_size,
            activation_dtype=self.activation_dtype,
            device=self.device,
            first_index=first_index,
            sequence_shards=self.sequence_shards,
            wgrad_queue=self.lora.wgrad_queue,
            on_step=on_step,
            on_refused=on_refused,
            log_every=log_every,
            record_events=record_events,
            graphs=self.graphs,
        )

    def warm_up(self, microbatch: Microbatch, make_batch: Callable) -> bool:
        """`pipeline.warm_up_stage` of ``microbatch``: its one-off costs paid, nothing kept.

        Call it before the run's first microbatch, while the gradient table holds nothing
        (it zeroes the whole table). While CUDA graphs are active it runs on their side
        stream, where the first (eager) microbatches will run. Returns whether this rank
        ran it (False: its replica has no share of ``microbatch``).
        """
        graphs = self.graphs is not None and self.graphs.active
        with self.graphs.side_stream(self.device) if graphs else contextlib.nullcontext():
            return warm_up_stage(
                microbatch,
                self.forward,
                make_batch,
                self.optimizer,
                self.lora.grads,
                self.groups,
                hidden_size=self.model.config.hidden_size,
                activation_dtype=self.activation_dtype,
                device=self.device,
                sequence_shards=self.sequence_shards,
                wgrad_queue=self.lora.wgrad_queue,
            )

    def load_table(self, slot: int, table: str, tensors: dict[str, torch.Tensor]) -> None:
        """Load one adapter's tensors of one table (`checkpoint.TABLES`) into row ``slot``.

        Raises:
            ValueError: naming every missing, unexpected or mis-shaped tensor.
        """
        from megatron_lorafusion.mcore.context import load_views

        target = {
            "weight": self.lora.weights,
            "exp_avg": self.optimizer.exp_avg,
            "exp_avg_sq": self.optimizer.exp_avg_sq,
        }[table]
        name = self.lora.adapters[slot].name
        load_views(self.lora.adapter_views(target, slot), tensors, f"the {table} of {name!r}")


def pipeline_groups(timeout_s: float) -> PipelineGroups:
    """This rank's runner groups from Megatron's parallel state (a collective under PP or DP).

    Args:
        timeout_s: timeout of every operation on the new groups, in seconds.
    """
    from megatron_lorafusion.mcore.parallel import parallel_sizes, pipeline_and_data_ranks
    from megatron_lorafusion.pipeline import make_pipeline_groups, one_stage_groups

    sizes = parallel_sizes()
    if sizes["pp"] == 1 and sizes["dp"] == 1:
        return one_stage_groups()
    return make_pipeline_groups(*pipeline_and_data_ranks(), timeout_s)


def adapter_training(
    lora,
    adapters: Sequence[AdapterConfig],
    batch_tokens: Sequence[Sequence[int]],
    *,
    track_grad_norms: bool = False,
) -> tuple[list[AdapterRun], AdapterAdamW]:
    """Fresh training state of the adapters on this rank: their runs and their optimizer.

    Under TP the optimizer's gradient norms sum over the TP peers (the runner then sums them
    over the stages).

    Args:
        lora: this rank's `LoRAContext`.
        adapters: the adapters, in id order.
        batch_tokens: per adapter, the trained tokens of each of its global batches (its loss
            denominators; one optimizer step per global batch).
        track_grad_norms: compute every step's gradient norm (`AdapterAdamW.grad_norm`).
    """
    from megatron.core import parallel_state

    norms = {}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        norms["squared_norms"] = tensor_parallel_squared_norms(
            lora,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_group(),
        )
    optimizer = AdapterAdamW(
        lora,
        adapters,
        [len(tokens) for tokens in batch_tokens],
        track_grad_norms=track_grad_norms,
        **norms,
    )
    runs = [
        AdapterRun(adapter.name, list(tokens))
        for adapter, tokens in zip(adapters, batch_tokens, strict=True)
    ]
    return runs, optimizer


def build_run(
    model_cfg: ModelConfig,
    adapters: Sequence[AdapterConfig],
    batch_tokens: Sequence[Sequence[int]],
    *,
    device: torch.device | str = "cpu",
    params_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    sequence_shards: int = 1,
    recompute: str | None = None,
    defer_wgrad: bool = False,
    track_grad_norms: bool = False,
    comm_timeout_s: float = 600.0,
    graphs_max_seqlen: int | None = None,
) -> Run:
    """Build this rank's run: groups, stage model, LoRA, optimizer and adapter runs.

    Args:
        model_cfg: the base model (random or ``hf_path`` weights, `mcore.build_gpt_model`).
        adapters: the adapters, in id order.
        batch_tokens: per adapter, the trained tokens of each of its global batches.
        device: where the model lives.
        params_dtype: dtype of the frozen base weights and the activations between stages.
        seed: LoRA initialisation seed.
        sequence_shards: TP size under sequence parallelism (on), else 1 (off).
        recompute: activation recompute mode (`mcore.RECOMPUTE_MODES`); None: leave it.
        defer_wgrad: defer LoRA A's weight gradients into a pipelined run's idle time (a run
            of one stage and one replica has none to fill and ignores it).
        track_grad_norms: compute every step's gradient norm.
        comm_timeout_s: timeout of the runner's process groups, in seconds.
        graphs_max_seqlen: train through CUDA graphs (`pipeline.MicrobatchGraphs`; one
            process on a GPU only), whose attention is launched for samples of up to this
            many tokens (microbatches padded to `GRAPH_PAD_TOKENS` while they are active);
            None: eagerly.

    Raises:
        ValueError: for graphs where they cannot run (see `graphs_apply`).
    """
    from megatron_lorafusion import mcore
    from megatron_lorafusion.mcore.recompute import apply_recompute

    device = torch.device(device)
    if graphs_max_seqlen is not None and (
        why_not := graphs_apply(device, recompute, params_dtype, adapters, model_cfg)
    ):  # refused before the model is built
        raise ValueError(f"CUDA graphs cannot train this run: {why_not}")
    groups = pipeline_groups(comm_timeout_s)
    model = mcore.build_gpt_model(
        model_cfg,
        params_dtype=params_dtype,
        device=device,
        pre_process=groups.is_first,
        post_process=groups.is_last,
        sequence_parallel=sequence_shards > 1,
    )
    lora = mcore.apply_lora(model, adapters, seed=seed)
    if recompute is not None:
        apply_recompute(model, lora, recompute)
    if defer_wgrad and (groups.num_stages > 1 or groups.dp_size > 1):
        lora.wgrad_queue = mcore.WgradQueue(max_pending=groups.num_stages)
    runs, optimizer = adapter_training(
        lora, adapters, batch_tokens, track_grad_norms=track_grad_norms
    )
    forward = gpt_stage_forward(model, lora, is_first=groups.is_first, is_last=groups.is_last)
    graphs = None
    if graphs_max_seqlen is not None:
        graphs = MicrobatchGraphs(
            lambda batch, denominators: adapter_losses(forward(batch, None), batch, denominators),
            max_seqlen=graphs_max_seqlen,
            before_capture=lora.drop_compute_weights,
            pad_tokens=GRAPH_PAD_TOKENS,
        )
    return Run(
        model=model,
        lora=lora,
        optimizer=optimizer,
        runs=runs,
        groups=groups,
        forward=forward,
        global_batch_sizes=[a.global_batch_size for a in adapters],
        activation_dtype=params_dtype,
        device=device,
        sequence_shards=sequence_shards,
        graphs=graphs,
    )


def graphs_apply(
    device: torch.device,
    recompute: str | None,
    dtype: torch.dtype,
    adapters: Sequence[AdapterConfig],
    model_cfg: ModelConfig,
) -> str:
    """Why CUDA graphs cannot train a run (``""``: they can).

    A graph replays launches only: everything a microbatch computes must stay on the GPU,
    sample boundaries included. So: one process on a GPU (no pipeline, data or tensor
    parallelism), FlashAttention (bf16 or fp16; the other kernels read the boundaries on the
    host), no full-layer recompute (torch's checkpoint reads the RNG state on the host), a
    bf16 base (not yet run with an FP8 one) and no DoRA adapter (its scales are gathered per
    microbatch on the host).
    """
    from megatron_lorafusion.mcore.attention import attention_backend, flash_window_available

    if device.type != "cuda":
        return f"they need a GPU, the run is on {device.type}"
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1:
        return f"they train one process only, the run has {world}"
    if attention_backend(device, dtype, 0.0) != "flash" or (
        model_cfg.sliding_window is not None and not flash_window_available()
    ):
        return f"they need FlashAttention (bf16 on an Ampere or newer GPU), the run is {dtype}"
    if recompute == "full":
        return "train.recompute 'full' recomputes layers with torch's checkpoint"
    if model_cfg.base_precision != "bf16":
        return f"they have not been run with model.base_precision {model_cfg.base_precision}"
    dora = [a.name for a in adapters if a.use_dora]
    if dora:
        return f"DoRA adapters ({', '.join(dora)}) gather their scales on the host"
    return ""
