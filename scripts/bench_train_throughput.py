"""Training throughput on one GPU: the many-adapter matrix (issue 21) and the peers (issue 15).

    python -m scripts.bench_train_throughput [--shapes llama3.1-8b] [--no-peers] [--csv out.csv]
    python -m scripts.bench_train_throughput --shapes qwen3-8b gemma3-12b --no-matrix \
        --layers 12 --microbatches 4   # issue 35: the Qwen3 and Gemma 3 shapes (fewer layers)
    python -m scripts.bench_train_throughput --shapes llama3.1-8b --no-matrix --no-peers \
        --attention flex    # issue 22: our rows on FlexAttention instead of FlashAttention
    python -m scripts.bench_train_throughput --shapes llama3.1-8b --no-matrix \
        --compare-attention flex   # issue 15's cell on FlexAttention too, in the same process
    python -m scripts.bench_train_throughput --device cpu --layers 1 --tokens 256 --microbatches 2
    python -m scripts.bench_train_throughput --shapes llama3.2-1b --microbatches 24 --passes 3
    python -m scripts.bench_train_throughput --shapes llama3.2-1b --no-compare --rounds 3
    python -m scripts.bench_train_throughput --shapes llama3.1-8b --no-matrix \
        --base-precision fp8   # issue 34: our rows on an FP8 frozen base, peers as always

Random bf16 weights, every linear adapted, one process, one GPU. The matrix (shape x rank x
dropout x adapters) applies LoRA afresh per cell to the model built once per shape, steps every
adapter with tokens in a microbatch right after it (one `AdapterAdamW` launch; a global batch of
one microbatch, the most steps a job can take), and reports tokens/s, the ratio to the 1-adapter
cell (timed before and again after the other counts of its rank and dropout, the mean of both:
clocks drift over a run; with ``--rounds N`` every count of a rank and dropout is timed in turn
N times instead, each cell its median round), GPU launches (kernels, memsets, copies seen by
torch.profiler) of one forward + backward and of one optimizer round of every adapter, that
round's time, peak memory and the mean loss of the timed pass. ``--attention`` forces our packed
attention's kernel (issue 22); runs that differ only in it see the same weights and
microbatches, so their losses compare.
The peers: transformers + PEFT (one adapter, same r and p on q/k/v/o/gate/up/down, 4 x T/4
tokens, SDPA, torch AdamW each microbatch) on the shape's family (``LlamaForCausalLM``,
``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``), with Liger-Kernel's RMSNorm, RoPE, SwiGLU (GeGLU
for Gemma 3) and fused linear cross-entropy too when ``liger_kernel`` is importable and has the
family (it patches transformers for good, so it runs last), each beside its floor: the
model without PEFT, frozen, its embedding output requiring grad so backward computes the
input gradients. Issue 15's table sets ours with 4
adapters r = 16 p = 0.1 and our floor (LoRA wrappers swapped out) against them.

Microbatches: T packed tokens, sample lengths drawn in [256, 2048] ([T/4, T] when T < 1024)
from the microbatch's index, so every cell of a shape sees the same lengths; samples go to the
adapters round-robin over the whole stream, adapter-major inside a microbatch. With 64 adapters
an 8192-token microbatch holds ~7 samples, so ``--microbatches`` is a minimum, extended until
every adapter has a sample. Time: CUDA-synchronised wall clock of every microbatch (host
included) after a warm-up pass over the same ones (over two of them in a matrix cell's later
``--rounds``, whose kernels and microbatches are ready), the median of ``--passes`` timed
passes; each cell reports the SM clock after its timing (clocks drop under sustained load, so
cells compare only at like clocks). A cell out of memory prints the reason; each result is
logged on stderr as it lands, the tables follow at the end.
``--device cpu``: an fp32 dry run on tiny sizes (hidden 64; PEFT runs too, Liger cannot).
"""

import argparse
import bisect
import csv
import functools
import gc
import importlib.metadata
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from functools import partial
from importlib.util import find_spec
from pathlib import Path

import torch

from megatron_lorafusion.config import MODEL_PRESETS, AdapterConfig, DatasetConfig, ModelConfig
from megatron_lorafusion.mcore import (
    LoRAColumnParallelLinear,
    LoRARowParallelLinear,
    apply_lora,
    build_gpt_model,
)
from megatron_lorafusion.mcore.attention import set_attention_backend
from megatron_lorafusion.mcore.parallel import (
    destroy_model_parallel,
    init_model_parallel,
    packed_seq_params,
)
from megatron_lorafusion.ops import AdapterLayout
from megatron_lorafusion.train.optim import AdapterAdamW

SHAPES = ("llama3.2-1b", "llama3.1-8b", "qwen3-8b", "gemma3-12b")
DEFAULT_SHAPES = SHAPES[:2]
TINY = dict(
    hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, head_dim=16
)
COMPARE = (16, 0.1, 4)  # issue 15's cell: rank, dropout, adapters
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_LORA = dict(target_modules=HF_TARGETS, task_type="CAUSAL_LM")
LIGER = dict(rope=True, rms_norm=True, fused_linear_cross_entropy=True)
LIGER_FAMILY = {  # family -> (Liger's patch function, its GLU keyword)
    "llama": ("apply_liger_kernel_to_llama", "swiglu"),
    "qwen3": ("apply_liger_kernel_to_qwen3", "swiglu"),
    "gemma3": ("apply_liger_kernel_to_gemma3_text", "geglu"),
}
KEY = ("shape", "what", "rank", "dropout", "adapters")  # of every result row
SPECS = dict(
    tokens_s=",.0f",
    launches=",",
    opt_launches=",",
    opt_ms=".2f",
    peak_gib=".1f",
    loss=".4f",
    sm_mhz="d",
)
FIELDS = ["device", "attention", *KEY, "layers", "tokens", "microbatches", *SPECS, "note"]
MATRIX = (
    "model=shape;r=rank;p=dropout;adapters=adapters;tokens/s=tokens_s;× 1 adapter=x_one;"
    "launches / mb=launches;opt launches=opt_launches;opt round ms=opt_ms;peak GiB=peak_gib;"
    "loss=loss;SM MHz=sm_mhz;ours / PEFT=x_peft;note=note"
)
COMPARISON = (
    "model=shape;what=what;r=rank;p=dropout;adapters=adapters;tokens/s=tokens_s;"
    "peak GiB=peak_gib;loss=loss;SM MHz=sm_mhz;ours 4 adapters / this=x_ours;note=note"
)


def _model_config(shape: str, args) -> ModelConfig:
    sizes = {**MODEL_PRESETS[shape], "max_position_embeddings": args.tokens}
    if args.device.type == "cpu":
        sizes.update(TINY, vocab_size=512)
    sizes["base_precision"] = args.base_precision
    return ModelConfig(**{**sizes, "num_layers": args.layers or sizes["num_layers"]})


def _adapters(count: int, rank: int, dropout: float) -> list[AdapterConfig]:
    shape = dict(rank=rank, alpha=2 * rank, dropout=dropout, dataset=DatasetConfig(path="unused"))
    return [AdapterConfig(name=f"a{i}", **shape) for i in range(count)]


@functools.lru_cache(maxsize=8)
def _microbatches(tokens: int, minimum: int, num_adapters: int, vocab: int, device) -> list:
    """``(ids (1, T), positions (1, T), AdapterLayout)`` of each microbatch (module docstring).

    Cached: a matrix cell's later rounds reuse its microbatches, layouts' device copies
    included, as its timed passes reuse those of its warm-up."""
    low, high = (256, 2048) if tokens >= 1024 else (tokens // 4, tokens)
    batches, drawn = [], 0
    while len(batches) < minimum or drawn < num_adapters:
        k = len(batches)
        rng, lengths = random.Random(k), []
        while sum(lengths) < tokens:
            lengths.append(min(tokens - sum(lengths), rng.randint(low, high)))
        owners = [(drawn + j) % num_adapters for j in range(len(lengths))]  # round-robin
        drawn += len(lengths)
        samples = sorted(zip(owners, lengths, strict=True), key=lambda s: s[0])  # adapter-major
        lengths = [n for _, n in samples]
        layout = AdapterLayout.from_samples(
            [a for a, _ in samples], lengths, num_adapters, device, dropout_seed=k
        )
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(k))
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        batches.append((ids.to(device), pos.to(device), layout))
    return batches


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _sm_clock_mhz(device) -> int | None:
    """The GPU's current SM clock (nvidia-smi), None off CUDA or without nvidia-smi."""
    if device.type != "cuda":
        return None
    query = ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i"]
    try:
        out = subprocess.run([*query, str(torch.cuda.current_device())], capture_output=True)
        return int(out.stdout.decode().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _measure(train, batches, args, warmup: int | None = None) -> dict:
    """Tokens/s of ``train(batch)`` over every batch after a warm-up over the first
    ``warmup`` of them (None: all; the median of ``args.passes`` timed passes), the SM clock
    right after them, the peak memory since the last reset, and the mean of the losses
    ``train`` returns in the first pass."""
    for batch in batches[:warmup]:  # warm-up: every kernel compiled and autotuned
        train(batch)
    seconds, losses = [], None
    for _ in range(args.passes):
        _sync(args.device)
        start = time.perf_counter()
        returned = [train(batch) for batch in batches]  # 0-dim tensors: no host sync
        _sync(args.device)
        seconds.append(time.perf_counter() - start)
        losses = losses or returned
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.type == "cuda" else None
    loss = None if None in losses else torch.stack(losses).mean().item()
    tokens_s = args.tokens * len(batches) / statistics.median(seconds)
    return {
        "tokens_s": tokens_s,
        "sm_mhz": _sm_clock_mhz(args.device),
        "peak_gib": peak,
        "loss": loss,
    }


def _launches(fn, device) -> int | None:
    """GPU activities (kernels, memsets, copies) that ``fn()`` launches; None off CUDA."""
    if device.type != "cuda":
        return None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def _kernel_profile(label: str, fn, device, top: int = 25) -> None:
    """Print the GPU time of ``fn()`` (after one warm-up call) by kernel name, longest first,
    with the kernel sum against the synchronised wall clock (the gap is host time)."""
    if device.type != "cuda":
        return
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall_ms = 1e3 * (time.perf_counter() - start)
    by_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            entry = by_name.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time / 1e3
            entry[1] += 1
    total = sum(ms for ms, _ in by_name.values())
    print(f"\n## kernels of one microbatch: {label} (sum {total:.1f} ms, wall {wall_ms:.1f} ms)")
    print("| kernel | ms | calls |\n|---|---|---|")
    for name, (ms, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name.replace('|', '/')} | {ms:.2f} | {calls} |")


_GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_OURS = "megatron_lorafusion/"


def _innermost(frames: list[tuple[float, float, str]], starts: list[float], t: float) -> str:
    """Name of the innermost of ``frames`` ((start, end, name), sorted by start) around ``t``."""
    for i in range(
        bisect.bisect_right(starts, t) - 1, max(-1, bisect.bisect_right(starts, t) - 5000), -1
    ):
        if frames[i][1] >= t:
            return frames[i][2]
    return "(outside our code)"


def host_waits(trace: dict, min_gap_us: float = 5.0, top: int = 10) -> str:
    """Where the GPU waited on the host in one chrome trace (``torch.profiler`` with
    ``with_stack=True``): idle gaps between GPU activities longer than ``min_gap_us``,
    each charged to the innermost frame of our package that launched the activity after it,
    and the host's synchronising calls (stream/device/event syncs, blocking copies) by frame.
    Returns markdown (two tables)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation"))
        for e in events
        if e.get("cat") in _GPU_CATEGORIES
    )
    launch_ts = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    frames = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"].split(_OURS, 1)[1])
        for e in events
        if e.get("cat") == "python_function" and _OURS in e["name"]
    )
    starts = [f[0] for f in frames]
    idle: dict[str, list[float]] = {}
    busy_until = gpu[0][1] if gpu else 0.0
    for start, end, correlation in gpu[1:]:
        if start - busy_until > min_gap_us:
            where = _innermost(frames, starts, launch_ts.get(correlation, start))
            entry = idle.setdefault(where, [0.0, 0])
            entry[0] += (start - busy_until) / 1e3
            entry[1] += 1
        busy_until = max(busy_until, end)
    syncs: dict[str, list[float]] = {}
    for e in events:
        blocking = e["name"] in _SYNC_CALLS or (
            e["name"].startswith("cudaMemcpy") and not e["name"].endswith("Async")
        )
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and blocking:
            entry = syncs.setdefault(
                f"{e['name']} in {_innermost(frames, starts, e['ts'])}", [0.0, 0]
            )
            entry[0] += e.get("dur", 0) / 1e3
            entry[1] += 1
    total = sum(ms for ms, _ in idle.values())
    gaps = sum(n for _, n in idle.values())
    lines = [
        f"GPU idle {total:.1f} ms in {gaps} gaps > {min_gap_us:g} us, by the code launching "
        "the next GPU work:",
        "| launched from | idle ms | gaps |",
        "|---|---|---|",
    ]
    for where, (ms, n) in sorted(idle.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {where} | {ms:.2f} | {n} |")
    lines += ["", "| host sync | ms | calls |", "|---|---|---|"]
    for where, (ms, n) in sorted(syncs.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {where} | {ms:.2f} | {n} |")
    return "\n".join(lines)


def _host_profile(label: str, fn, path: Path) -> None:
    """Print `host_waits` of one ``fn()`` under the Python tracer (it slows the host, so the
    idle times are inflated; where they fall is what this shows); the trace goes to ``path``."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    print(f"\n## host waits of one microbatch: {label} (trace {path})")
    print(host_waits(json.loads(path.read_text())))


def _step_ms(step, device, rounds: int = 21) -> float:
    """Median synchronised time of ``step()``, in ms."""
    times = []
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _free() -> None:
    gc.collect()  # Megatron modules hold reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # each measurement's peak is its own


def _guarded(fn, *args) -> dict:
    """``fn(*args)``, or a row naming the reason when it ran out of memory; memory freed."""
    _free()
    try:
        result = fn(*args)
    except torch.cuda.OutOfMemoryError:
        result = {"note": f"CUDA OOM at {torch.cuda.memory_allocated() / 2**30:.1f} GiB"}
    _free()  # after the except block: the traceback held the failed cell's tensors
    return result


def _median_row(rows: list[dict]) -> dict:
    """One cell from its rounds: the median round's row by tokens/s (the lower middle of an
    even count) with the first round's loss (every cell's first round trains its adapters
    from the same start over the same steps, so their losses compare), or the last note when
    no round ran."""
    timed = sorted((r for r in rows if r.get("tokens_s")), key=lambda r: r["tokens_s"])
    if not timed:
        return rows[-1]
    return {**timed[(len(timed) - 1) // 2], "loss": rows[0].get("loss")}


def _put(results: dict, key: tuple, row: dict) -> None:
    """Store a result and log it at once on stderr, so a run cut short still shows its cells."""
    results[key] = row
    print(f"# {key}: {row}", file=sys.stderr, flush=True)


def _unwrap(model) -> None:
    """Swap every LoRA wrapper's base linear back in (also after apply_lora failed halfway)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRAColumnParallelLinear | LoRARowParallelLinear):
                setattr(module, name, child.base)


def _present(batch) -> tuple[int, ...]:
    """The adapters with tokens in the microbatch: each steps after it (a global batch of one
    microbatch); an adapter without tokens has no gradient, and no job steps it then."""
    return batch[2].present_ids()


def _forward_backward(model, lora, batch) -> torch.Tensor:
    """The microbatch's mean loss (detached) after its backward."""
    ids, pos, layout = batch
    if lora is not None:
        lora.layout = layout
    loss = model(ids, pos, None, labels=ids, packed_seq_params=packed_seq_params(layout))
    loss = loss.float().mean()
    loss.backward()
    return loss.detach()


def _ours(
    model,
    model_cfg: ModelConfig,
    args,
    rank: int,
    dropout: float,
    count: int,
    warmup: int | None = None,
) -> dict:
    """One matrix cell: LoRA applied afresh, timed (``warmup``: `_measure`'s), probed, and
    swapped out again."""
    adapters, everyone = _adapters(count, rank, dropout), list(range(count))
    try:
        lora = apply_lora(model, adapters, seed=0)
        with torch.no_grad():
            for a in everyone:
                for name, factor in lora.adapter_tensors(a).items():
                    if name.endswith("lora_B"):  # non-zero, so every factor gets gradients
                        factor.normal_(0, 0.01)
        optimizer = AdapterAdamW(lora, adapters, total_steps=[1000] * count)
        batches = _microbatches(
            args.tokens, args.microbatches, count, model_cfg.vocab_size, args.device
        )

        def train(batch) -> torch.Tensor:
            loss = _forward_backward(model, lora, batch)
            optimizer.step(_present(batch))
            return loss

        row = _measure(train, batches, args, warmup)
        if args.profile and (rank, dropout, count) == COMPARE:
            _kernel_profile(f"ours, {count} adapters", lambda: train(batches[0]), args.device)
            if args.device.type == "cuda":
                trace = args.profile_dir / f"ours_{count}_adapters.json"
                _host_profile(f"ours, {count} adapters", lambda: train(batches[0]), trace)
        row["launches"] = _launches(lambda: _forward_backward(model, lora, batches[0]), args.device)
        # The round of every adapter, after one untimed round (its row ids' first copy to the
        # GPU, cached per step group), on zeroed gradients: the fused step's work does not
        # depend on their values.
        optimizer.step(everyone)
        row["opt_launches"] = _launches(lambda: optimizer.step(everyone), args.device)
        row["opt_ms"] = _step_ms(lambda: optimizer.step(everyone), args.device)
        return row
    finally:
        _unwrap(model)


def _floor(train, batches, embedding, args, label: str) -> dict:
    """``_measure`` of a frozen model whose embedding output requires grad (input grads)."""
    hook = embedding.register_forward_hook(lambda module, inputs, out: out.requires_grad_())
    try:
        row = _measure(train, batches, args)
        if args.profile:
            _kernel_profile(label, lambda: train(batches[0]), args.device)
            if args.device.type == "cuda":
                trace = args.profile_dir / f"{label.replace(' ', '_').replace('+', '_')}.json"
                _host_profile(label, lambda: train(batches[0]), trace)
        return row
    finally:
        hook.remove()


def _run_ours(shape: str, args, results: dict, builds: dict) -> None:
    """Our model of ``shape``, built once: every matrix cell, then issue 15's rows."""
    model_cfg = _model_config(shape, args)
    start = time.perf_counter()
    model = build_gpt_model(model_cfg, params_dtype=args.dtype, device=args.device)
    set_attention_backend(model, args.backend)
    builds[f"ours {shape}"] = time.perf_counter() - start

    def run(what: str, cell: tuple) -> None:
        _put(results, (shape, what, *cell), _guarded(_ours, model, model_cfg, args, *cell))

    counts = sorted(args.adapters)
    # Clocks drift: one adapter again after the rest, or every count in turn, round after round.
    again = 1 in counts and len(counts) > 1 and args.rounds == 1
    for rank, dropout in itertools.product(args.ranks, args.dropouts) if args.matrix else []:
        timed = {count: [] for count in counts}
        for round_ in range(args.rounds):
            warmup = None if round_ == 0 else 2  # compiled and tuned in the first round
            for count in counts:
                row = _guarded(_ours, model, model_cfg, args, rank, dropout, count, warmup)
                timed[count].append(row)
                if args.rounds > 1:
                    cell = (shape, rank, dropout, count)
                    print(f"# round {round_ + 1}, {cell}: {row}", file=sys.stderr, flush=True)
        for count, rows in timed.items():
            _put(results, (shape, "ours", rank, dropout, count), _median_row(rows))
        if again:
            run("ours again", (rank, dropout, 1))
    if args.compare and (shape, "ours", *COMPARE) not in results:
        run("ours", COMPARE)
    if args.compare:
        batches = _microbatches(
            args.tokens, args.microbatches, COMPARE[2], model_cfg.vocab_size, args.device
        )
        train = partial(_forward_backward, model, None)
        row = _guarded(_floor, train, batches, model.embedding, args, "ours base")
        _put(results, (shape, "ours base", None, None, None), row)
        for backend in args.compare_attention:  # issue 15's cell again, another kernel
            key = (shape, f"ours {backend}", *COMPARE)
            if args.device.type != "cuda":
                _put(results, key, {"note": f"{backend} attention needs CUDA"})
                continue
            set_attention_backend(model, backend)
            _put(results, key, _guarded(_ours, model, model_cfg, args, *COMPARE))
        set_attention_backend(model, args.backend)


def _hf_config(model_cfg: ModelConfig):
    """The transformers config of ``model_cfg``'s family and sizes (Llama, Qwen3, Gemma 3)."""
    import transformers

    sizes = dict(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_query_groups,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rms_norm_eps=model_cfg.norm_epsilon,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        use_cache=False,
    )
    if model_cfg.family == "llama":
        return transformers.LlamaConfig(**sizes, rope_theta=model_cfg.rope_theta)
    if model_cfg.family == "qwen3":
        return transformers.Qwen3Config(
            **sizes, head_dim=model_cfg.head_dim, rope_theta=model_cfg.rope_theta
        )
    types = model_cfg.layer_types or ["sliding_attention"]
    full = {"rope_type": "default", "rope_theta": model_cfg.rope_theta}
    if model_cfg.rope_linear_factor is not None:
        full = {**full, "rope_type": "linear", "factor": model_cfg.rope_linear_factor}
    return transformers.Gemma3TextConfig(
        **sizes,
        head_dim=model_cfg.head_dim,
        query_pre_attn_scalar=int(model_cfg.query_pre_attn_scalar),  # Gemma's are integers
        sliding_window=model_cfg.sliding_window,
        layer_types=[types[i % len(types)] for i in range(model_cfg.num_layers)],
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": model_cfg.rope_local_theta},
        },
    )


def _hf_model(model_cfg: ModelConfig, args):
    """A random transformers model of the same family and sizes, built on the device, frozen."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(model_cfg)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=args.dtype
        )
    return model.requires_grad_(False).train()


def _hf_step(model, optimizer, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _peft(model, batches, args, rank: int, dropout: float) -> dict:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, **PEFT_LORA)
    peft_model = get_peft_model(model, config)
    try:
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        return _measure(
            partial(_hf_step, peft_model, torch.optim.AdamW(trainable, lr=1e-4)), batches, args
        )
    finally:
        peft_model.unload()  # takes the LoRA layers out of ``model`` again


def _liger_unavailable(device, family: str) -> str | None:
    if find_spec("liger_kernel") is None:
        return "liger_kernel not installed"
    if device.type != "cuda":
        return "Liger-Kernel needs CUDA (Triton kernels)"
    import liger_kernel.transformers

    name = LIGER_FAMILY[family][0]
    if not hasattr(liger_kernel.transformers, name):
        return f"liger-kernel {_version('liger-kernel')} has no {name}"
    return None


def _run_peers(shape: str, args, results: dict, builds: dict, liger: bool) -> None:
    """A plain (or Liger-patched) HF model: its floor, then PEFT on each (r, p) asked for."""
    what = "PEFT+Liger" if liger else "PEFT"
    cells = [] if liger or not args.matrix else list(itertools.product(args.ranks, args.dropouts))
    cells = list(dict.fromkeys(cells + ([COMPARE[:2]] if args.compare else [])))
    keys = [(shape, f"{what} floor", None, None, None)] + [(shape, what, *c, 1) for c in cells]
    model_cfg = _model_config(shape, args)
    if liger:
        if reason := _liger_unavailable(args.device, model_cfg.family):
            for key in keys:
                _put(results, key, {"note": reason})
            return
        import liger_kernel.transformers

        name, glu = LIGER_FAMILY[model_cfg.family]
        getattr(liger_kernel.transformers, name)(**LIGER, **{glu: True})  # for good

    start = time.perf_counter()
    model = _hf_model(model_cfg, args)
    builds[f"{what} {shape}"] = time.perf_counter() - start
    generator, size = torch.Generator().manual_seed(0), (4, args.tokens // 4)
    batches = [
        torch.randint(0, model_cfg.vocab_size, size, generator=generator).to(args.device)
        for _ in range(args.microbatches)
    ]
    floor = partial(_hf_step, model, None)
    embedding = model.get_input_embeddings()
    _put(results, keys[0], _guarded(_floor, floor, batches, embedding, args, f"{what} floor"))
    for key, cell in zip(keys[1:], cells, strict=True):
        _put(results, key, _guarded(_peft, model, batches, args, *cell))


def _row(results: dict, key: tuple, **extra) -> dict:
    """The result at ``key`` with its key fields, as a table or CSV row."""
    return {**dict(zip(KEY, key, strict=True)), **results.get(key, {}), **extra}


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else ""


def _print_table(columns: str, rows: list[dict]) -> None:
    """``columns``: ``header=field`` pairs, ``;``-separated; values formatted by SPECS."""
    header, fields = zip(*(c.split("=") for c in columns.split(";")), strict=True)
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        cells = ("" if row.get(f) is None else format(row[f], SPECS.get(f, "")) for f in fields)
        print("| " + " | ".join(cells) + " |")


def _print_matrix(results: dict, args) -> None:
    rows = []
    for shape, rank, dropout in itertools.product(args.shapes, args.ranks, args.dropouts):
        peft = _row(results, (shape, "PEFT", rank, dropout, 1), adapters="PEFT, 1")
        keys = [(shape, "ours", rank, dropout, count) for count in sorted(args.adapters)]
        again = (shape, "ours again", rank, dropout, 1)
        keys += [again] if again in results else []
        ones = [results.get(k, {}).get("tokens_s") for k in keys if k[-1] == 1]
        ones = [v for v in ones if v]
        one = statistics.mean(ones) if ones else None  # both 1-adapter timings
        for key in keys:
            row = _row(results, key, **({"adapters": "1, again"} if key == again else {}))
            speed = row.get("tokens_s")
            rows.append(
                {**row, "x_one": _ratio(speed, one), "x_peft": _ratio(speed, peft.get("tokens_s"))}
            )
        rows += [peft] if args.peers else []
    _print_table(MATRIX, rows)


def _print_compare(results: dict, args) -> None:
    """Issue 15's rows: ours, our floor, PEFT, its floor, PEFT + Liger, its floor."""
    whats = ["ours", "ours base", "PEFT", "PEFT floor", "PEFT+Liger", "PEFT+Liger floor"]
    peer, floor = (*COMPARE[:2], 1), (None, None, None)
    cells = [COMPARE, floor, peer, floor, peer, floor]
    rows = []
    for shape in args.shapes:
        keys = [(shape, w, *c) for w, c in zip(whats, cells, strict=True)][: 6 if args.peers else 2]
        keys[2:2] = [(shape, f"ours {b}", *COMPARE) for b in args.compare_attention]
        ours = results.get(keys[0], {}).get("tokens_s")
        for key in keys:
            row = _row(results, key)
            rows.append({**row, "x_ours": _ratio(ours, row.get("tokens_s"))})
    _print_table(COMPARISON, rows)


def _write_csv(path: Path, results: dict, args, device_name: str) -> None:
    new = not path.exists() or path.stat().st_size == 0
    run = dict(device=device_name, attention=args.backend, layers=args.layers, tokens=args.tokens)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerows(
            _row(results, key, microbatches=args.microbatches, **run) for key in results
        )


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_off = argparse.BooleanOptionalAction
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(DEFAULT_SHAPES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 64])
    parser.add_argument("--dropouts", nargs="+", type=float, default=[0.0, 0.1])
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--layers", type=int, help="override the preset's layer count")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per microbatch")
    parser.add_argument("--microbatches", type=int, default=8, help="timed microbatches (min)")
    parser.add_argument(
        "--passes", type=int, default=1, help="timed passes per cell (tokens/s of the median)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="matrix: time every adapter count of a rank and dropout in turn this many times "
        "(each cell the median round); above 1 the 1-adapter cell is not timed again",
    )
    parser.add_argument("--matrix", action=on_off, default=True, help="issue 21's matrix")
    parser.add_argument("--compare", action=on_off, default=True, help="issue 15's table")
    parser.add_argument("--peers", action=on_off, default=True, help="transformers (+ Liger)")
    parser.add_argument(
        "--ours", action=on_off, default=True, help="our rows (--no-ours: the peers only)"
    )
    parser.add_argument("--device", type=torch.device, default="cuda", help="cpu: a dry run")
    parser.add_argument(
        "--base-precision",
        choices=["bf16", "fp8"],
        default="bf16",
        help="our frozen base's linears (model.base_precision); the peers stay bf16",
    )
    parser.add_argument("--csv", type=Path, help="append every row to this CSV file")
    parser.add_argument(
        "--profile", action="store_true", help="kernel and host-wait tables of issue 15's rows"
    )
    parser.add_argument(
        "--profile-dir", type=Path, default=Path("."), help="where --profile writes its traces"
    )
    parser.add_argument(
        "--attention",
        choices=["flash", "flex"],
        default="flash",
        help="our packed attention's kernel on CUDA (the CPU dry run runs the per-sample loop)",
    )
    parser.add_argument(
        "--compare-attention",
        nargs="*",
        choices=["flash", "flex"],
        default=[],
        help="issue 15's cell again on each of these kernels, in the same process",
    )
    args = parser.parse_args(argv)
    if args.tokens < 16 or args.tokens % 4:
        parser.error(f"--tokens must be a multiple of 4 and >= 16, got {args.tokens}")
    sizes = (args.microbatches, args.passes, args.rounds, *args.adapters, *args.ranks)
    if min(*sizes, args.layers or 1) < 1:
        parser.error(
            "--microbatches, --passes, --rounds, --adapters, --ranks and --layers must be positive"
        )
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    args.backend = args.attention if args.device.type == "cuda" else "loop"
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the bench; returns every result row by ``(shape, what, rank, dropout, adapters)``."""
    args = _parse_args(argv)
    results, builds = {}, {}
    init_model_parallel(1, 1, args.device, seed=0)
    try:
        for shape in args.shapes:
            if args.ours:
                _run_ours(shape, args, results, builds)
            if args.peers:
                _run_peers(shape, args, results, builds, liger=False)
        for shape in args.shapes if args.peers and args.compare else []:
            _run_peers(shape, args, results, builds, liger=True)  # last: Liger patches for good
    finally:
        destroy_model_parallel()
    name = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU"
    print(
        f"# {name} | torch {torch.__version__} | triton {_version('triton')} | "
        f"transformers {_version('transformers')} | peft {_version('peft')} | "
        f"liger-kernel {_version('liger-kernel')} | {str(args.dtype).removeprefix('torch.')} | "
        f"attention {args.backend} | base {args.base_precision} | "
        f"{args.tokens}-token microbatches, >= {args.microbatches} timed after a warm-up pass"
        + (f", matrix cells in {args.rounds} rounds" if args.rounds > 1 else "")
    )
    print("# build s: " + ", ".join(f"{k} {v:.1f}" for k, v in builds.items()))
    if args.matrix:
        _print_matrix(results, args)
    if args.compare:
        print()
        _print_compare(results, args)
    if args.csv:
        _write_csv(args.csv, results, args, name)
    return results


if __name__ == "__main__":
    main()
