"""The job file: typed dataclass configs, YAML loading with dotted overrides, validation.

A YAML job maps one-to-one onto `JobConfig` (sections ``model``, ``adapters``, ``data``,
``planner``, ``parallel``, ``train``, ``logging``). Every problem found is collected and raised
together as one `ConfigError` whose lines read ``<section>.<field> must be <rule>, got <value>``;
the cross-field rules live in `validation.py`.
Loading touches no torch or CUDA; it reads no file but ``model.hf_path``'s ``config.json`` and
checks the datasets for existence.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_lorafusion.hf_config import hf_model_fields
from megatron_lorafusion.targets import ALL_LINEAR, FUSED_LINEARS, PROJECTIONS, TARGET_MODULES
from megatron_lorafusion.validation import validate
from megatron_lorafusion.yaml_limits import MAX_JOB_BYTES, expansion_problem

MAX_FUSED_RANK = 256
"""Largest rank of one adapter on one fused linear (the kernels' register limit)."""

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # A random base with std 0.02 caps the logits of a narrow model near uniform (the final
    # RMSNorm fixes |h|); std 0.15 lets the demo's adapters steer the output (losses fall
    # 40-75% in 150 steps instead of 5-15%).
    "tiny": dict(
        num_layers=2,
        hidden_size=128,
        ffn_hidden_size=352,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=260,
        max_position_embeddings=1024,
        init_method_std=0.15,
    ),
    "small": dict(
        num_layers=4,
        hidden_size=256,
        ffn_hidden_size=704,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=260,
        max_position_embeddings=2048,
    ),
    "llama3.2-1b": dict(
        num_layers=16,
        hidden_size=2048,
        ffn_hidden_size=8192,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    "llama3.1-8b": dict(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    # Qwen3-8B's config.json (random weights): head_dim 128, per-head q/k norms, untied.
    "qwen3-8b": dict(
        family="qwen3",
        num_layers=36,
        hidden_size=4096,
        ffn_hidden_size=12288,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        norm_epsilon=1e-6,
    ),
    # Gemma-3-12B's text model (random weights): head_dim 256 != 3840 / 16, five 1024-token
    # sliding-window layers (RoPE base 10k) to one global layer (base 1M, linear scaling 8).
    "gemma3-12b": dict(
        family="gemma3",
        num_layers=48,
        hidden_size=3840,
        ffn_hidden_size=15360,
        num_attention_heads=16,
        num_query_groups=8,
        head_dim=256,
        vocab_size=262208,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rope_local_theta=10000.0,
        rope_linear_factor=8.0,
        sliding_window=1024,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        query_pre_attn_scalar=256.0,
        norm_epsilon=1e-6,
        tie_word_embeddings=True,
    ),
    # ~141 GB of bf16 weights: on one H200 only with base_precision: fp8 (~73 GB) and
    # train.recompute: full (configs/llama70b_fp8.yaml, docs/fp8.md).
    "llama3.1-70b": dict(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
}


class ConfigError(ValueError):
    """Every problem found in a job config, one per line.

    ``problems`` holds them all; the message shows the first `SHOWN` (each cut at `WIDTH`
    characters), then how many more there are: a job with 900,000 unknown keys is one
    screen, not 128 MB.
    """

    SHOWN = 50
    """Problems the message lists."""
    WIDTH = 1000
    """Characters of one problem the message shows (a value may be a megabyte of text)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        shown = [
            q if len(q) <= self.WIDTH else f"{q[: self.WIDTH]}... ({len(q)} characters)"
            for q in self.problems[: self.SHOWN]
        ]
        more = len(self.problems) - len(shown)
        tail = f"\n  ... and {more} more problem{'s' if more > 1 else ''}" if more else ""
        super().__init__("invalid job config:\n  - " + "\n  - ".join(shown) + tail)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-like decoder (RMSNorm, gated MLP, RoPE, grouped-query attention).

    Random weights from ``init_seed``, or a Hugging Face checkpoint's with ``hf_path`` (its
    ``config.json`` then sets every size below). ``family`` names what Qwen3 and Gemma 3
    change in the Llama layer (docs/models.md).
    """

    preset: str | None = None
    """Named size preset (tiny, small, llama3.2-1b, llama3.1-8b, llama3.1-70b, qwen3-8b,
    gemma3-12b); explicit keys override it."""
    hf_path: str | None = None
    """Local Hugging Face checkpoint folder (config.json + safetensors) of a Llama, Mistral,
    Qwen2, Qwen3 or Gemma 3 model; its sizes replace the defaults and its weights the random
    init."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width H."""
    ffn_hidden_size: int = 176
    """SwiGLU inner width (each of gate and up)."""
    num_attention_heads: int = 4
    """Query heads; must divide hidden_size."""
    num_query_groups: int = 2
    """Key/value heads (grouped-query attention); must divide num_attention_heads."""
    vocab_size: int = 260
    """Vocabulary size; must cover the tokenizer (byte tokenizer: 259)."""
    max_position_embeddings: int = 1024
    """Longest sequence the rotary embedding is built for, in tokens."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_scaling_factor: float | None = None
    """Llama 3.x RoPE frequency scaling factor (low/high frequency factors 1 and 4, original
    context 8192 tokens); None: plain RoPE. Set from hf_path."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    init_seed: int = 0
    """Seed of the random base weights (the same seed gives the same frozen model)."""
    init_method_std: float = 0.02
    """Std of the random base weights (Megatron's default); output-side ones are scaled down."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projections (Qwen2); set from hf_path."""
    tie_word_embeddings: bool = False
    """The checkpoint shares input embedding and output layer (kept as two equal frozen copies
    here); set from hf_path."""
    sliding_window: int | None = None
    """Attention window of the sliding-window layers in tokens: a token attends to itself and
    the sliding_window - 1 tokens before it in its sample (Mistral: every layer; Gemma 3: see
    layer_types). Set from hf_path."""
    family: Literal["llama", "qwen3", "gemma3"] = "llama"
    """Layer structure. llama: Llama, Mistral, Qwen2 (pre-norms, SwiGLU); qwen3: plus a
    per-head RMSNorm on queries and keys; gemma3: plus norms after attention and after the
    MLP, a GeGLU (tanh GELU) MLP, embeddings scaled by sqrt(hidden_size), RMSNorm scales
    stored as 1 + weight. Set from hf_path."""
    head_dim: int | None = None
    """Size of each query/key/value head; None: hidden_size / num_attention_heads (Qwen3 and
    Gemma 3 set their own). Set from hf_path."""
    layer_types: list[str] | None = None
    """Attention of each layer, full_attention or sliding_attention; layer i takes entry
    i mod len (Gemma 3's preset lists one period: five sliding, one full); None: every layer
    sliding when sliding_window is set, else full. Set from hf_path."""
    rope_local_theta: float | None = None
    """Rotary base of the sliding-window layers (Gemma 3: 10000); None: rope_theta."""
    rope_linear_factor: float | None = None
    """Linear RoPE scaling of the full-attention layers, positions divided by this factor
    (Gemma 3 4B and larger: 8); None: none. Set from hf_path."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar^-1/2 (Gemma 3); None: by
    head_dim^-1/2. Set from hf_path."""
    hf_multimodal: bool = False
    """hf_path is a Gemma3ForConditionalGeneration: only its language model is imported
    (the vision tower is not trained), and exports name the modules as that class does
    (model.language_model.layers.*). Set from hf_path."""
    base_precision: Literal["bf16", "fp8"] = "bf16"
    """Storage of the frozen decoder linears. ``bf16``: train.precision's dtype. ``fp8``: e4m3
    with one power-of-two scale per output channel, quantized once at load (from the
    train.precision values, tensor by tensor); activations and incoming gradients quantized
    per token on the fly; their GEMMs on FP8 tensor cores (compute capability >= 8.9;
    refused on older GPUs). Half the weight memory; embeddings, norms, the output layer,
    attention and adapters unchanged. On CPU a torch reference quantizes alike
    (docs/fp8.md)."""


def attention_head_dim(model: ModelConfig) -> int:
    """Size of each attention head of ``model``: ``head_dim``, or hidden / heads."""
    return model.head_dim or model.hidden_size // model.num_attention_heads


@dataclass(frozen=True)
class DatasetConfig:
    """One adapter's training rows: a JSON/JSONL/Parquet/CSV file, dataset folder or hub name.

    Each row becomes a prompt and a response (``prompt_field``/``response_field``, or a
    ``template`` filled from the row's fields), or a chat (``messages_field``, rendered with the
    tokenizer's chat template). The loss covers response (assistant) tokens by default.
    """

    path: str = ""
    """Local file or dataset folder (e.g. a downloaded hub snapshot; relative to the working
    directory), or a hub dataset name when data.offline is false. A path ending in
    .json/.jsonl/.parquet/.csv must exist; ``lorafusion validate`` reads a local file's first
    1,000 rows as training would."""
    format: Literal["auto", "json", "parquet", "csv"] = "auto"
    """File format; auto = from the suffix (.jsonl and .json are json)."""
    split: str = "train"
    """Split of a dataset folder or hub dataset (a single file has only ``train``)."""
    prompt_field: str = "prompt"
    """Key of the prompt text in each row (unused with template or messages_field)."""
    response_field: str = "response"
    """Key of the response text in each row; the loss covers only these tokens by default."""
    template: str | None = None
    """Prompt template: a registered name (``alpaca``: instruction/input fields) or a format
    string with ``{field}`` placeholders, e.g. ``"Q: {question}\nA: "``."""
    messages_field: str | None = None
    """Key of a chat (list of ``{role, content}``) per row, rendered with the tokenizer's chat
    template; the loss covers the assistant turns. Needs a tokenizer folder."""


@dataclass(frozen=True)
class AdapterConfig:
    """One LoRA adapter: its shape, its optimizer and its data."""

    name: str = ""
    """Unique name; also the export folder's name."""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Where this adapter's training samples come from."""
    rank: int = 8
    """LoRA rank r (1..256; PEFT's key ``r`` is accepted for it). Each projection named in
    target_modules gets its own rank-r factors, so r × projections of one fused linear
    (3 for q/k/v, 2 for gate/up) must stay <= 256."""
    alpha: float = 16.0
    """LoRA alpha (PEFT's ``lora_alpha`` is accepted); scale = alpha / r (alpha / sqrt(r)
    with use_rslora), the same for every adapted module."""
    dropout: float = 0.0
    """Dropout on the LoRA input, in [0, 1) (PEFT's ``lora_dropout`` is accepted). One mask
    per linear input: the projections of a fused linear (q/k/v, gate/up) see the same mask,
    where PEFT draws one per module (equal at 0 and in evaluation; docs/adapters.md)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""
    use_dora: bool = False
    """DoRA (PEFT's ``use_dora``): each adapted linear's output rows are rescaled by a
    trainable magnitude m over the detached row norm of W + scale·B·A (m starts at the norm
    of W's row, so a fresh adapter is the base model); parallel.tp = 1 only."""
    loraplus_lr_ratio: float = 1.0
    """LoRA+ (PEFT's ``create_loraplus_optimizer`` ratio): the learning rate of B, and of
    DoRA magnitudes as PEFT groups them, is lr × this; A keeps lr. 1 = plain AdamW (the
    LoRA+ paper suggests 16)."""
    target_modules: list[str] = field(default_factory=lambda: list(FUSED_LINEARS))
    """Modules to adapt. Megatron's linear_qkv, linear_proj, linear_fc1, linear_fc2: one LoRA
    per fused linear (one A shared by q, k and v, or by gate and up); Hugging Face's q_proj,
    k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: one LoRA per projection, exactly
    what PEFT trains on those modules; ``all-linear`` (also as a bare string): all seven
    projections, each its own LoRA. Each projection may be named once."""
    lr: float = 1e-3
    """Peak learning rate of this adapter's AdamW."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """Decay after warm-up (to min_lr_ratio × lr at the last step)."""
    warmup_steps: int = 0
    """Linear warm-up, in optimizer steps (at most 10^7)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr for cosine/linear schedules."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    global_batch_size: int = 8
    """Samples per optimizer step (at most 10^8). Steps follow the training order across
    epoch boundaries, as Megatron's sample-based training does: with fewer training rows than
    this, one step holds some rows twice. train.steps × this, summed over adapters, must stay
    within 10^8 samples and the host memory planning takes (~1 KiB a sample)."""
    max_grad_norm: float = 1.0
    """Clip this adapter's gradient to this L2 norm (over all its factors, on every TP / PP /
    DP rank) before each step, 1.0 as HF/TRL and torchtune; 0 does not clip."""
    eval_dataset: DatasetConfig | None = None
    """Held-out rows for evaluation (same keys as dataset); None: none, or eval_fraction."""
    eval_fraction: float = 0.0
    """Fraction of the training rows held out for evaluation instead, in [0, 1); 0: none."""
    early_stopping_patience: int = 0
    """Stop stepping this adapter after this many evaluations (train.eval_every) without a
    new best eval loss, and export its best weights; 0: never stop early. At most 10^7."""


@dataclass(frozen=True)
class DataConfig:
    """Tokenisation, truncation, caching and bad-row policy, shared by all adapters."""

    tokenizer: str = "byte"
    """``byte`` (no download: 256 bytes + pad, bos, eos) or a local folder that
    ``transformers.AutoTokenizer`` loads. Unset with ``model.hf_path``: that folder (the
    model's own vocabulary); ``byte`` there only when set explicitly."""
    max_seq_length: int = 256
    """Longest sample after the truncation policy, in tokens."""
    truncation: Literal["truncate", "reject"] = "truncate"
    """Longer samples are cut to max_seq_length (the prompt from its left first, then the
    response from its right), or rejected with an error naming them. A sample left with no
    trained token is an error naming it (a counted skip with bad_rows: skip)."""
    train_on_prompt: bool = False
    """Also put loss on prompt tokens (default: response tokens only)."""
    shuffle: bool = True
    """Shuffle each adapter's samples per epoch (seeded by train.seed)."""
    bad_rows: Literal["error", "skip"] = "error"
    """A malformed row (a line that is not JSON, a CSV record with more or fewer fields than
    its header, a missing or non-text field) stops loading with an error naming file and row,
    or is skipped and counted (one warning per dataset)."""
    cache_dir: str | None = None
    """Folder of tokenised datasets, reused while file, fields, template, tokenizer and
    truncation are unchanged; also the ``datasets`` download cache. None: no cache."""
    offline: bool = False
    """Never reach the hub: dataset paths must be local files or folders."""


@dataclass(frozen=True)
class PlannerConfig:
    """How samples of all adapters are packed into microbatches."""

    solver: Literal["greedy", "milp"] = "greedy"
    """Packing algorithm; greedy: the MILP saved <= 1 % of microbatches (docs/planner.md)."""
    token_capacity: int = 1024
    """Tokens per microbatch (tile padding included); higher = fewer bubbles, more memory."""
    tile_height: int = 1
    """Kernel tile height in tokens; each adapter's segment is padded to a multiple of it."""
    time_limit_s: float = 0.1
    """Time limit of one MILP solve, in seconds (planning runs ahead in a worker process)."""


@dataclass(frozen=True)
class ParallelConfig:
    """Model parallel sizes; data parallel size is world size / (tp × pp)."""

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size (stages)."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism when ``tp > 1``: outside the tensor-parallel linears
    (norms, residuals, activations passed between pipeline stages) each TP rank holds
    ``T / tp`` of a microbatch's ``T`` tokens, cutting that activation memory by ``tp`` at the
    cost of an all-gather / reduce-scatter pair instead of each all-reduce. On by default, as
    Megatron users expect with TP; has no effect at ``tp = 1`` or on CPU runs (Megatron's
    sequence-parallel collectives need CUDA). Microbatches are padded to a multiple of ``tp``
    tokens with a loss-free sample."""
    defer_wgrad: bool = False
    """Defer each LoRA down-projection's weight-gradient pass into pipeline idle time
    (zero-bubble style; needs pp > 1; docs/pipeline.md has the measured gain)."""


@dataclass(frozen=True)
class TrainConfig:
    """The training run."""

    steps: int | None = None
    """Optimizer steps per adapter (exactly one of steps and epochs; at most 10^7)."""
    epochs: int | None = None
    """Passes over each adapter's dataset (exactly one of steps and epochs; at most 10^7).
    Every planned sample (epochs × training rows, summed over adapters) is held in host
    memory, ~1 KiB each: at most 10^8 samples, and no more than the memory free. validate
    checks it from the first 1,000 rows of each file, train from all of them."""
    seed: int = 1234
    """Seed of adapter init, shuffling and dropout."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Dtype of the frozen base and activations; adapters and optimizer states stay fp32.
    fp16 is refused: it would need dynamic loss scaling, which is not implemented."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available."""
    output_dir: str = "runs/default"
    """Checkpoints and exported adapters go here; created only after validation."""
    save_every: int = 0
    """Checkpoint each adapter every this many of its own optimizer steps, right after the
    step, in the background (training goes on); 0: none. Each adapter is exported as soon
    as it is done, whatever this is. At most 10^7."""
    save_buffer_gib: float | None = None
    """Host memory for saves in flight, in GiB: a save copies the adapter's rows here and a
    writer thread writes them; training waits only when it is full (a disk slower than the
    saves, which a warning reports). None (default): two saves of every adapter trained at
    once, at most a quarter of the machine's memory split over its ranks (at 8B r 16, 64
    adapters: 55 GB wanted, 32 GiB on a 128 GiB machine). On CUDA it is pinned, one buffer
    per adapter, and torch pins each buffer rounded up to a power of two (0.428 GB at 8B
    r 16 takes 0.5 GiB)."""
    resume: Literal["auto", "never"] = "auto"
    """``auto``: each adapter continues from its own newest usable checkpoint in output_dir
    (a damaged one is skipped with a warning), and adapters already done are not trained
    again; ``never``: start fresh."""
    overwrite: bool = False
    """Write into an output_dir that holds files not of a lorafusion run (refused by
    default); the run's own files (job.json, checkpoints/, adapters/<name>/, ...) replace
    same-named ones there."""
    keep_last: int = 3
    """Complete checkpoints kept per adapter (older ones are deleted; under early stopping
    its best one is kept too); 0 keeps all. At most 10^7."""
    eval_every: int = 0
    """Evaluate each adapter that has eval data every this many of its optimizer steps (and at
    its last); 0: never. At most 10^7."""
    recompute: Literal["none", "selective", "full"] = "selective"
    """Activation recomputation in backward (memory for compute). ``selective``: the LoRA
    wrappers of linear_qkv, linear_fc1 and linear_fc2 rebuild their norm / SwiGLU input
    instead of keeping it (one more norm and SwiGLU pass per layer; gradients bit-identical to
    ``none``; ~11 GiB less for an 8B microbatch of 8192 tokens); ``full``: each decoder layer
    keeps only its input and runs its forward again in backward (one more forward per step)."""
    cuda_graphs: Literal["auto", True, False] = "auto"
    """Train microbatches through CUDA graphs: a microbatch shape seen three times is captured
    and then replayed (one launch instead of ~1,000: a small model's host no longer holds the
    GPU back). Microbatches are padded to a multiple of 256 tokens (loss-free) so shapes
    repeat. They run for `lorafusion train` in one process on a GPU with FlashAttention and a
    bf16 base, without ``recompute: full``, DoRA adapters or a token capacity off a multiple
    of 256. ``auto``: on where they run (the log says which, and why not); ``true``: refused
    with the reason where they cannot; ``false``: off. One adapter on Llama-3.2-1B ran 1.53x
    faster at global batch 8 and 1.12x at 32; runs of many adapters rarely repeat a shape
    and train as without them (docs/throughput.md)."""


@dataclass(frozen=True)
class LoggingConfig:
    """Progress and metrics."""

    log_every: int = 1
    """Log one line every this many optimizer steps of the slowest adapter (at most 10^7)."""
    progress_bar: bool = True
    """Show a tqdm bar on rank 0."""
    level: Literal["DEBUG", "INFO", "WARNING"] = "INFO"
    """Python logging level."""


SHORTEST_FIRST_MICROBATCHES = 2
"""``server.policy: shortest`` trains the jobs with the fewest tokens left (at least two)
whose global batches fill this many microbatches a round: fewer leave microbatches partly
filled (a Llama-3.2-1B microbatch costs ~100 ms of host time whatever its size)."""


@dataclass(frozen=True)
class ServerConfig:
    """A long-running trainer (`lorafusion serve`): jobs join and leave through its root."""

    root: str = ""
    """The server's folder: ``inbox/`` (submitted jobs), ``jobs/<name>/`` (each job's
    checkpoints, PEFT folder ``adapter/``, metrics and status), ``server.json``. A shared
    filesystem is all several nodes need."""
    max_adapters: int = 8
    """Jobs trained at once (rows of the adapter tables, allocated at start-up); more wait
    in arrival order."""
    max_rank: int = 64
    """Largest LoRA rank a job may have; every row is allocated at this rank (a job of a
    lower rank computes at it too: the LoRA passes are a few % of a step)."""
    idle_timeout_s: float = 0.0
    """Exit after this many seconds without a job to train or wait for; 0: never."""
    poll_s: float = 2.0
    """Seconds between reads of the inbox and of cancel requests while jobs train."""
    policy: Literal["online", "shortest", "fifo", "batch"] = "online"
    """When queued jobs start and which running jobs train: ``online`` starts a job as soon as
    a row is free and trains every running job at once (one global batch of each per round);
    ``shortest`` starts jobs as ``online`` does but trains those with the fewest tokens left
    first, at least two and enough to fill two microbatches per round (the others wait in
    their rows: short jobs finish sooner; a long one waits while shorter ones keep coming);
    ``fifo`` one job at a time in arrival order (jobs run one by one); ``batch`` only when
    the server is empty, then every queued job (static batches). The last two are the
    baselines of ``scripts/bench_serve_trace.py``."""


@dataclass(frozen=True)
class JobConfig:
    """A whole job: one YAML file (a server's has a ``server`` section and no adapters)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    adapters: list[AdapterConfig] = field(default_factory=list)
    data: DataConfig = field(default_factory=DataConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    server: ServerConfig | None = None


def _literal_text(value: Any) -> str:
    """A literal as YAML spells it (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(_literal_text(v) for v in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, where: str, problems: list[str]) -> Any:
    """Check ``value`` against the annotation ``tp``; nested dataclasses are built."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        before = len(problems)
        converted = _convert(value, inner, where, problems)
        plain = not dataclasses.is_dataclass(inner) and typing.get_origin(inner) is not list
        if plain and len(problems) > before:  # the key's own value: say that unset is valid
            problems[before] = problems[before].replace(" must be ", " must be null or ", 1)
        return converted
    if origin is Literal:  # by type too: 1 == True, but 1 is no YAML true
        if not any(type(value) is type(v) and value == v for v in typing.get_args(tp)):
            problems.append(f"{where} must be {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{where} must be a list, got {value!r}")
            return value
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{where}.{i}", problems) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, problems)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float) and isinstance(value, bool) or not isinstance(value, tp):
        problems.append(f"{where} must be of type {_type_name(tp)}, got {value!r}")
    return value


ADAPTER_ALIASES = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}
"""PEFT's names of adapter keys; the resolved job holds only ours (the values)."""

_PEFT_HINTS = {
    "task_type": "PEFT's task type: every adapter here is a causal LM (CAUSAL_LM); drop it",
    "bias": "biases are never trained here (PEFT's bias: none); drop it",
    "modules_to_save": "only LoRA factors are trained here; drop it",
    "init_lora_weights": "A is kaiming-uniform and B zero, PEFT's default; drop it",
    "fan_in_fan_out": "not needed: Llama-like linears are (out, in); drop it",
    "lora_r": "write 'rank' (or PEFT's 'r')",
}
"""Hints for PEFT ``LoraConfig`` keys that have no counterpart here."""


def _unknown_key_hint(key: str, names: list[str], where: str) -> str:
    """``; <hint>`` for an unknown ``key`` of section ``where`` (empty when none fits)."""
    where = where.removeprefix("job.")
    for linear, projections in PROJECTIONS.items():
        if key == linear or key in projections or key == ALL_LINEAR:
            covered = "" if key in (linear, ALL_LINEAR) else f" (inside the fused {linear})"
            place = where if where.startswith("adapters.") else "adapters.<i>"
            return f"; {key!r} is a target module{covered}: list it in {place}.target_modules"
    if key in _PEFT_HINTS:
        return f"; {_PEFT_HINTS[key]}"
    if key == "target_modules" and not where.startswith("adapters."):
        return "; target_modules belongs to each adapter: adapters.<i>.target_modules"
    hint = difflib.get_close_matches(str(key), names, n=1)
    return f"; did you mean {hint[0]!r}?" if hint else ""


def _build(cls: type, raw: Any, where: str, problems: list[str]) -> Any:
    """Build dataclass ``cls`` from a mapping, recording unknown keys and type errors.

    An adapter's PEFT-named keys (`ADAPTER_ALIASES`) set our field; naming both is an error.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{where} must be a mapping, got {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    aliases = ADAPTER_ALIASES if cls is AdapterConfig else {}
    kwargs = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in names:
            # Past the problems the message shows, a hint (difflib, ~0.2 ms) is never read.
            hinted = len(problems) < ConfigError.SHOWN
            suffix = _unknown_key_hint(str(key), names + list(aliases), where) if hinted else ""
            if where == "job":  # a top-level key: "job." is dropped from the message
                problems.append(
                    f"job file section {str(key)!r} must be one of {names}, "
                    f"got an unknown section{suffix}"
                )
            else:
                problems.append(f"{where}.{key} is not a known key{suffix}")
            continue
        if name != key and name in raw:
            problems.append(
                f"{where}.{key} and {name} set the same value ({key!r} is "
                f"PEFT's name for {name!r}): give one, got {key}={value!r}, "
                f"{name}={raw[name]!r}"
            )
            continue
        if name == "target_modules" and value == ALL_LINEAR:  # PEFT's bare string
            value = [ALL_LINEAR]
        before = len(problems)
        converted = _convert(value, hints[name], f"{where}.{key}", problems)
        items = converted if isinstance(converted, list) else [converted]
        if len(problems) == before or items and all(dataclasses.is_dataclass(v) for v in items):
            kwargs[name] = converted  # a wrong value keeps the default, so validate() runs
    return cls(**kwargs)


def _apply_preset(raw: dict, problems: list[str]) -> dict:
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("preset") is None:
        return raw
    preset = model["preset"]
    if not isinstance(preset, str) or preset not in MODEL_PRESETS:  # {} or [] are unhashable
        hint = difflib.get_close_matches(str(preset), MODEL_PRESETS, n=1)
        suffix = f"; did you mean {hint[0]!r}?" if hint else ""
        problems.append(
            f"model.preset must be one of {sorted(MODEL_PRESETS)}, got {preset!r}{suffix}"
        )
        return raw
    return {**raw, "model": {**MODEL_PRESETS[preset], **model}}


def _apply_hf_model(raw: dict, problems: list[str]) -> dict:
    """Fill ``model`` from ``model.hf_path``; an explicit key that disagrees is a problem."""
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("hf_path") is None:
        return raw
    if model.get("preset") is not None:
        problems.append(f"model.preset must be unset with model.hf_path, got {model['preset']!r}")
    fields, hf_problems = hf_model_fields(str(model["hf_path"]))
    problems.extend(f"model.hf_path: {q}" for q in hf_problems)
    for key, value in fields.items():
        if key in model and model[key] != value:
            problems.append(
                f"model.{key} must match the checkpoint's config.json ({value!r}) "
                f"or be left out, got {model[key]!r}"
            )
    raw = {**raw, "model": {**model, **fields}}
    data = raw.get("data", {})
    if isinstance(data, dict) and "tokenizer" not in data:  # the model's own vocabulary
        raw["data"] = {**data, "tokenizer": str(model["hf_path"])}
    return raw


def _absolute(section: Any, key: str) -> None:
    """Make ``section[key]`` absolute (from the current folder) when it names a local path.

    A hub dataset name, ``byte`` or a missing path stays as written (validation names it).
    """
    if not isinstance(section, dict) or not isinstance(section.get(key), str):
        return
    text = section[key]
    try:
        local = bool(text) and Path(text).exists()
    except (OSError, ValueError):  # a NUL byte, a name too long: validation reports it
        return
    if local:
        section[key] = os.path.abspath(text)


def _resolve_paths(raw: dict) -> None:
    """Resolve relative model, tokenizer and dataset paths in place.

    The resolved job (``job.json``, the export's ``base_model_name_or_path``) then names the
    same files from any folder; resume compares resolved jobs on both sides.
    """
    _absolute(raw.get("model"), "hf_path")
    _absolute(raw.get("server"), "root")
    if isinstance(raw.get("data"), dict) and raw["data"].get("tokenizer") != "byte":
        _absolute(raw["data"], "tokenizer")  # "byte" is a name, even beside a folder "byte"
    adapters = raw.get("adapters")
    for adapter in adapters if isinstance(adapters, list) else []:
        if isinstance(adapter, dict):
            _absolute(adapter.get("dataset"), "path")
            _absolute(adapter.get("eval_dataset"), "path")


class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """PyYAML's safe loader, except that a key repeated in one mapping is an error.

    libyaml's parser where PyYAML has it: a 1.2 MB file loads in 1.7 s instead of 6.7 s (its
    parsing in 0.3 s instead of 5.4 s; the rest is PyYAML's constructor, in Python).
    """


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base" may override keys
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            repeated = key in first
        except TypeError:  # an unhashable key: the safe constructor reports it
            continue
        if repeated:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first on line {first[key]})",
                key_node.start_mark,
            )
        first[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _yaml_problem(err: yaml.YAMLError, text: str) -> tuple[int | None, str]:
    """``(line, problem)`` of a PyYAML error (line 1-based, None when unknown)."""
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        problem = ", ".join(str(q) for q in (err.context, err.problem) if q)
        return (None if mark is None else mark.line + 1), problem
    if isinstance(err, yaml.reader.ReaderError):  # a control character
        return text[: err.position].count("\n") + 1, f"unacceptable character {err.character!r}"
    return None, str(err)


def _read_job_yaml(path: Path) -> Any:
    """The parsed job file; every error names the file and, where it has one, the line.

    Encoding, syntax, duplicate keys, nesting and alias expansion (`yaml_limits`) are
    checked; a file over `MAX_JOB_BYTES` is not read.

    Raises:
        ConfigError: naming ``path`` and the line of the problem.
    """
    with path.open("rb") as f:  # never more than the limit, whatever the file holds
        data = f.read(MAX_JOB_BYTES + 1)
    if len(data) > MAX_JOB_BYTES:
        raise ConfigError(
            [
                f"job file {str(path)!r} must be at most {MAX_JOB_BYTES >> 20} MiB (a job "
                f"file is a few KB), got {path.stat().st_size / 2**20:.1f} MiB"
            ]
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            [f"job file {str(path)!r}, line {line}: not UTF-8 text (byte 0x{data[err.start]:02x})"]
        ) from None
    try:
        refused = expansion_problem(text, _UniqueKeyLoader)
        if refused is None:
            return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
        line, problem = refused
    except yaml.YAMLError as err:
        line, problem = _yaml_problem(err, text)
    where = f"job file {str(path)!r}" + ("" if line is None else f", line {line}")
    raise ConfigError([f"{where}: {problem}"]) from None


def _set_dotted(raw: dict, dotted: str, problems: list[str]) -> None:
    """Apply one ``a.b.c=value`` override (list items by index: ``adapters.0.lr=1e-4``)."""
    key, sep, text = dotted.partition("=")
    if not sep or not key:
        problems.append(f"override {dotted!r} must look like section.key=value")
        return
    node: Any = raw
    parts = key.split(".")
    for part in parts[:-1]:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            problems.append(f"override {dotted!r}: {part!r} does not name a section or list item")
            return
    last = parts[-1]
    try:
        refused = expansion_problem(text, _UniqueKeyLoader)
        if refused is not None:
            problems.append(f"override {dotted!r}: {refused[1]}")
            return
        value = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as err:
        problems.append(
            f"override {dotted!r}: the value is not valid YAML ({_yaml_problem(err, text)[1]})"
        )
        return
    if isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        problems.append(f"override {dotted!r}: {last!r} does not name a key")


def load_config(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read, override and validate a YAML job file.

    Args:
        path: the YAML file.
        overrides: dotted ``section.key=value`` strings applied after reading.

    Returns:
        The validated `JobConfig`.

    Raises:
        ConfigError: listing every problem (unknown keys, wrong types, broken rules).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"job file {str(path)!r} does not exist"])
    raw = _read_job_yaml(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"job file {str(path)!r} must hold a mapping of sections"])
    problems: list[str] = []
    for dotted in overrides or []:
        _set_dotted(raw, dotted, problems)
    raw = _apply_preset(raw, problems)
    _resolve_paths(raw)
    raw = _apply_hf_model(raw, problems)
    cfg = _build(JobConfig, raw, "job", problems)
    # Section names read better without the "job." prefix.
    problems = [q.removeprefix("job.") for q in problems]
    problems += _unmasked(validate(cfg) + _target_problems(cfg), problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def _unmasked(rules: list[str], problems: list[str]) -> list[str]:
    """The cross-field problems that do not involve a key already reported.

    A key with a wrong type or value was built with its default; a rule that reads it would
    report the default, not what the user wrote. A failed preset or ``hf_path`` leaves the
    whole model section unknown.
    """
    keys = {q.split(" ", 1)[0].rstrip(":") for q in problems}
    if any(k in ("model.preset", "model.hf_path") for k in keys):
        keys.add("model")
    if not keys:
        return rules

    def masked(rule: str) -> bool:  # a set lookup per dotted prefix: 100,000 keys stay fast
        for name in _DOTTED.findall(rule):
            parts = name.split(".")
            if any(".".join(parts[:n]) in keys for n in range(1, len(parts) + 1)):
                return True
        return False

    return [q for q in rules if not masked(q)]


_DOTTED = re.compile(r"(?<![\w.])[\w.]+")
"""A dotted key as a problem names it (``adapters.0.rank``); a reported key masks a rule that
names it or a key below it."""


@dataclass(frozen=True)
class JobSpec:
    """One job submitted to a server: an adapter and how long it trains.

    Attributes:
        adapter: the adapter (a job file's ``adapters`` entry).
        steps: its optimizer steps, or None.
        epochs: its passes over its dataset, or None (both None: the server's train section).
    """

    adapter: AdapterConfig
    steps: int | None = None
    epochs: int | None = None


_JOB_LENGTH_KEYS = ("steps", "epochs")


def load_submission(path: str | Path, server: JobConfig | None = None) -> list[JobSpec]:
    """Read and validate a job file for ``lorafusion submit``.

    It holds ``adapters:``, each entry an adapter of a job file (same keys) plus its own
    ``steps`` or ``epochs``. It is checked against ``server``'s job (its model, data,
    planner and train sections), or the defaults when the server has not started yet.

    Raises:
        ConfigError: listing every problem, with ``adapters.<i>`` naming the entry.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"job file {str(path)!r} does not exist"])
    raw = _read_job_yaml(path)
    problems: list[str] = []
    if not isinstance(raw, dict) or set(raw) != {"adapters"}:
        shown = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ConfigError(
            [
                f"job file {str(path)!r} must hold one section, adapters (a list of "
                f"adapters, each with its own steps or epochs), got {shown}"
            ]
        )
    entries = raw["adapters"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError([f"adapters must be a non-empty list, got {entries!r}"])
    lengths = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            problems.append(f"adapters.{i} must be a mapping, got {entry!r}")
            lengths.append((None, None))
            continue
        steps, epochs = (entry.pop(k, None) for k in _JOB_LENGTH_KEYS)
        for key, value in zip(_JOB_LENGTH_KEYS, (steps, epochs), strict=True):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                problems.append(f"adapters.{i}.{key} must be a positive integer, got {value!r}")
        if steps is not None and epochs is not None:
            problems.append(f"adapters.{i} must set steps or epochs, not both")
        lengths.append((steps, epochs))
    base = dataclasses.asdict(server if server is not None else JobConfig(server=ServerConfig()))
    base["adapters"] = entries
    if server is None:  # nothing to take the length from: a job must say its own
        base["train"]["steps"] = 1
    _resolve_paths(base)
    cfg = _build(JobConfig, base, "job", problems)
    problems = [q.removeprefix("job.") for q in problems]
    if server is None and any(s is None and e is None for s, e in lengths):
        problems.append(
            "adapters.<i>.steps or epochs must be set while the server has not started "
            "(a running server gives its train.steps or train.epochs as the default)"
        )
    rules = [q for q in validate(dataclasses.replace(cfg, server=None)) if "adapters" in q]
    problems += _unmasked(rules + _target_problems(cfg), problems)
    if problems:
        raise ConfigError(problems)
    return [JobSpec(a, s, e) for a, (s, e) in zip(cfg.adapters, lengths, strict=True)]


def job_from_dict(raw: dict) -> JobConfig:
    """Rebuild a `JobConfig` saved as ``dataclasses.asdict`` (a run's ``job.json``).

    Keys and types are checked; the cross-field rules and dataset files are not (a finished
    run's datasets may be gone).

    Raises:
        ConfigError: on unknown keys or wrong types.
    """
    problems: list[str] = []
    cfg = _build(JobConfig, raw, "job", problems)
    if problems:
        raise ConfigError([q.removeprefix("job.") for q in problems])
    return cfg


def adapter_scaling(adapter: AdapterConfig) -> float:
    """LoRA scale of ``adapter``: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return adapter.alpha / (adapter.rank**0.5 if adapter.use_rslora else adapter.rank)


def lora_blocks(target_modules: Sequence[str]) -> dict[str, tuple[tuple[str, ...], ...]]:
    """The LoRA blocks of an adapter on each Megatron linear it adapts.

    A block is a group of Hugging Face projections that share one ``(A, B)`` pair of rank r:
    a Megatron name is one block of all its projections (one ``A`` for q, k and v), a Hugging
    Face name a block of its own (PEFT's module), ``all-linear`` every projection on its own.
    On a fused linear the adapter's blocks are stacked into one LoRA of rank ``blocks × r``
    (docs/adapters.md).

    Args:
        target_modules: names from `TARGET_MODULES`.

    Returns:
        Per adapted linear (in `FUSED_LINEARS` order), its blocks in the linear's row order;
        e.g. ``[q_proj, v_proj, linear_fc2]`` gives ``{"linear_qkv": (("q_proj",),
        ("v_proj",)), "linear_fc2": (("down_proj",),)}``.

    Raises:
        ValueError: for an unknown name, or a projection named twice (``linear_qkv`` and
            ``q_proj``, ``all-linear`` and anything else); the message reads on after
            ``target_modules``.
    """
    owner: dict[str, str] = {}  # projection -> the entry that names it
    whole: set[str] = set()
    for entry in target_modules:
        if entry not in TARGET_MODULES:
            raise ValueError(f"must be a subset of {list(TARGET_MODULES)}, got {entry!r}")
        if entry == ALL_LINEAR:
            covered = [p for ps in PROJECTIONS.values() for p in ps]
        else:
            covered = list(PROJECTIONS.get(entry, (entry,)))
        if entry in PROJECTIONS:
            whole.add(entry)
        for projection in covered:
            if projection in owner:
                raise ValueError(
                    f"must name each projection once, got {projection!r} in both "
                    f"{owner[projection]!r} and {entry!r}"
                )
            owner[projection] = entry
    blocks = {}
    for linear, projections in PROJECTIONS.items():
        if linear in whole:
            blocks[linear] = (projections,)
        elif chosen := tuple((p,) for p in projections if p in owner):
            blocks[linear] = chosen
    return blocks


def fused_ranks(adapter: AdapterConfig) -> dict[str, int]:
    """Rank of ``adapter`` on each Megatron linear it adapts: ``blocks × r`` (`lora_blocks`)."""
    return {
        linear: len(blocks) * adapter.rank
        for linear, blocks in lora_blocks(adapter.target_modules).items()
    }


def _target_problems(cfg: JobConfig) -> list[str]:
    """Overlapping targets and fused ranks above `MAX_FUSED_RANK`, one line per adapter.

    Unknown names and ranks outside 1..256 are `validation`'s problems.
    """
    problems = []
    for i, adapter in enumerate(cfg.adapters):
        where = f"adapters.{i}"
        if not set(adapter.target_modules) <= set(TARGET_MODULES):
            continue
        try:
            ranks = fused_ranks(adapter)
        except ValueError as err:
            problems.append(f"{where}.target_modules {err}")
            continue
        linear = max(ranks, key=ranks.get, default=None)
        if linear is None or not 1 <= adapter.rank <= 256 or ranks[linear] <= MAX_FUSED_RANK:
            continue
        blocks = ranks[linear] // adapter.rank
        problems.append(
            f"{where}.rank must be <= {MAX_FUSED_RANK // blocks} with target_modules "
            f"{adapter.target_modules}: {blocks} projections of {linear} each get "
            f"rank-r factors, stacked into one LoRA of rank {blocks}·r <= "
            f"{MAX_FUSED_RANK} in the fused kernels, got {adapter.rank}"
        )
    return problems
