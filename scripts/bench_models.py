"""Issue 35 on one GPU: Qwen3-8B- and Gemma-3-12B-shaped jobs through ``lorafusion train``,
then the same shapes against transformers + PEFT (+ Liger) in the throughput bench.

    python -m scripts.bench_models [--layers 6] [--steps 4] [--shapes qwen3-8b gemma3-12b]
    python -m scripts.bench_models --write-data runs/models/data   # the jobs' data only

1. Correctness first, per family on the GPU: a small random model of the family (head size
   other than hidden / heads; Gemma 3 with a 64-token window on one of two layers, samples up
   to 300 tokens) in bf16 on the fused path (Triton q/k-norm + RoPE split, GeGLU, windowed
   FlashAttention) against the same model in fp32 on the torch reference path (per-sample
   SDPA loop), which the CPU tests hold equal to transformers; a mismatch stops the run.
2. Each shape's job (``configs/<shape>.yaml``, 4 adapters r = 16, p = 0.1, 8192-token
   microbatches of 256-2048-token random-letter samples) runs through the real CLI in a child
   process (``python -m megatron_lorafusion train``), on ``--layers`` layers for a short
   timing run; its steady tokens/s comes from its step log (`steady_tokens_per_s`: the
   intervals after every adapter's first step, past compilation), its wall time from start
   to exit.
3. ``scripts.bench_train_throughput --no-matrix --no-ours`` on the same shapes and layers,
   in this process: PEFT (1 adapter r = 16, p = 0.1, 4 x 2048 tokens), its floor, and
   PEFT + Liger where ``liger_kernel`` has the family (it prints its own table); with
   ``--with-ours`` also its rows of ours (4 adapters) and our base on its own microbatches.

A last table sets the CLI's tokens/s beside the bench's rows.
"""

import argparse
import datetime
import json
import random
import re
import string
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = ("qwen3-8b", "gemma3-12b")
REPO = Path(__file__).resolve().parents[1]
# dtype -> tolerance of bf16 fused logits against fp32 reference logits, relative to their
# largest magnitude. Measured with the torch references in bf16 on the CPU: 1.7e-2 (Qwen3),
# 6e-3 (Gemma 3); dropping Gemma 3's window gives 0.46, Qwen3's q/k norms 0.52.
CHECK_TOL = {torch.bfloat16: 0.1}


def write_data(folder: Path, adapters: int = 4, rows: int = 96, seed: int = 0) -> None:
    """``a{i}.jsonl`` of random-letter prompts of 224-2008 letters and 32-letter responses."""
    folder.mkdir(parents=True, exist_ok=True)
    for a in range(adapters):
        rng = random.Random(f"{seed}/{a}")
        with (folder / f"a{a}.jsonl").open("w", encoding="utf-8") as f:
            for _ in range(rows):
                prompt = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(224, 2008)))
                response = "".join(rng.choices(string.ascii_lowercase, k=32))
                f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


def _check_family(family: str, device: str = "cuda") -> float:
    """Largest |bf16 fused - fp32 reference| / max |reference| of a small model's logits."""
    from megatron_lorafusion.config import ModelConfig
    from megatron_lorafusion.mcore import build_gpt_model, fused_base, set_attention_backend
    from megatron_lorafusion.mcore.parallel import packed_seq_params
    from megatron_lorafusion.ops import AdapterLayout

    extra = {
        "qwen3": {},
        "gemma3": dict(
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
            rope_local_theta=1e4,
            rope_linear_factor=8.0,
            query_pre_attn_scalar=96.0,
            tie_word_embeddings=True,
        ),
    }[family]
    cfg = ModelConfig(
        family=family,
        num_layers=2,
        hidden_size=256,
        ffn_hidden_size=512,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=96,
        vocab_size=1024,
        max_position_embeddings=512,
        init_method_std=0.05,
        **extra,
    )
    lengths = [300, 17, 129, 64, 1]
    layout = AdapterLayout.from_samples([0] * len(lengths), lengths, 1, device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=generator).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    logits = {}
    fused = fused_base.use_fused_kernels
    for dtype, backend in ((torch.bfloat16, "auto"), (torch.float32, "loop")):
        model = build_gpt_model(cfg, params_dtype=dtype, device=device).eval()
        set_attention_backend(model, backend)
        if dtype == torch.float32:  # the reference: every op's torch form
            fused_base.use_fused_kernels = lambda x: False
        try:
            with torch.no_grad():
                out = model(ids, positions, None, packed_seq_params=packed_seq_params(layout))
        finally:
            fused_base.use_fused_kernels = fused
        logits[dtype] = out.float()
    reference = logits[torch.float32]
    return ((logits[torch.bfloat16] - reference).abs().max() / reference.abs().max()).item()


def _check(shapes) -> None:
    from megatron_lorafusion.config import MODEL_PRESETS
    from megatron_lorafusion.mcore.parallel import destroy_model_parallel, init_model_parallel

    init_model_parallel(1, 1, torch.device("cuda"), seed=0)
    try:
        for family in sorted({MODEL_PRESETS[s]["family"] for s in shapes}):
            error = _check_family(family)
            print(f"# check {family}: bf16 fused vs fp32 reference, max rel error {error:.2e}")
            if not error <= CHECK_TOL[torch.bfloat16]:
                raise SystemExit(f"{family}: fused logits are off the reference ({error:.2e})")
    finally:
        destroy_model_parallel()
        torch.cuda.empty_cache()  # the jobs run in child processes: leave them the memory


_STEP_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO megatron_lorafusion\.pipeline\.runner: "
    r"adapter (\S+) step (\d+) \|.*\| ([\d.]+)k tok/s$"
)


def steady_tokens_per_s(lines: list[str]) -> tuple[float | None, int]:
    """Tokens/s of a ``lorafusion train`` log after every adapter's first step, and the
    number of step-log intervals it covers.

    The runner logs, with each group of steps, the tokens/s since its previous step line
    (`pipeline.runner`); the intervals after the one that holds the last adapter's first step
    (compilation, autotuning, the planner's first chunk) are averaged, weighted by their
    lengths from the log's timestamps.
    """
    events = []  # (time s, adapter, step, rate), in log order
    for line in lines:
        match = _STEP_LINE.match(line.strip())
        if match:
            stamp = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            events.append((stamp, match[2], int(match[3]), 1e3 * float(match[4])))
    adapters = {e[1] for e in events}
    seen, warm = set(), None
    for i, (_, adapter, step, _) in enumerate(events):
        if step == 1:
            seen.add(adapter)
        if seen == adapters:
            warm = i
            break
    if warm is None:
        return None, 0
    intervals, last = [], events[warm][0]
    for stamp, _, _, rate in events[warm + 1 :]:
        if stamp > last:  # a new group of steps: its rate covers (last, stamp]
            intervals.append((stamp - last, rate))
            last = stamp
    total = sum(dt for dt, _ in intervals)
    if not total:
        return None, 0
    return sum(dt * rate for dt, rate in intervals) / total, len(intervals)


def _train(shape: str, args) -> dict:
    """``lorafusion train configs/<shape>.yaml`` in a child process; its timings."""
    out = args.out / f"{shape}-{args.layers or 'all'}L"
    overrides = [
        f"train.output_dir={out}",
        f"train.steps={args.steps}",
        "train.overwrite=true",
        "logging.progress_bar=false",
        *[f"adapters.{a}.dataset.path={args.out / 'data' / f'a{a}.jsonl'}" for a in range(4)],
    ]
    if args.layers:
        overrides.append(f"model.num_layers={args.layers}")
    config = REPO / "configs" / f"{shape.replace('-', '_')}.yaml"
    command = [sys.executable, "-m", "megatron_lorafusion", "train", str(config), *overrides]
    print("# " + " ".join(command), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in child.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    code = child.wait()
    wall = time.perf_counter() - start
    if code != 0:
        return {"note": f"lorafusion train exited {code}", "wall_s": wall}
    rate, intervals = steady_tokens_per_s(lines)
    return {"tokens_s": rate, "intervals": intervals, "wall_s": wall}


def _bench(shapes, args) -> dict:
    """The throughput bench's comparison rows, by (shape, what)."""
    import scripts.bench_train_throughput as bench

    argv = ["--shapes", *shapes, "--no-matrix", "--microbatches", str(args.microbatches)]
    if not args.with_ours:
        argv.append("--no-ours")  # the CLI's run stands for ours
    if args.layers:
        argv += ["--layers", str(args.layers)]
    if args.csv:
        argv += ["--csv", str(args.csv)]
    return {key[:2]: row for key, row in bench.main(argv).items()}


def _print_summary(train: dict, bench: dict, args) -> None:
    whats = ("ours", "PEFT", "PEFT+Liger")
    print(
        f"\n## lorafusion train against the peers ({args.layers or 'all'} layers, "
        f"{args.steps} steps per adapter)\n"
    )
    print(
        "| model | train tokens/s | log intervals | train wall s | bench ours | PEFT | "
        "PEFT+Liger | train / PEFT | train / PEFT+Liger | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, row in train.items():
        peers = [bench.get((shape, w), {}).get("tokens_s") for w in whats]
        rate = row.get("tokens_s")
        ratios = [f"{rate / p:.2f}" if rate and p else "" for p in peers[1:]]
        cells = [
            shape,
            f"{rate:,.0f}" if rate else "",
            str(row.get("intervals", "")),
            f"{row['wall_s']:.0f}",
            *(f"{p:,.0f}" if p else "" for p in peers),
            *ratios,
            row.get("note", "") or bench.get((shape, "PEFT+Liger"), {}).get("note", ""),
        ]
        print("| " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--layers", type=int, default=6, help="0: the presets' full depth")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per adapter")
    parser.add_argument("--microbatches", type=int, default=3, help="bench: timed microbatches")
    parser.add_argument("--out", type=Path, default=Path("runs/models"))
    parser.add_argument("--csv", type=Path, help="bench rows appended here")
    parser.add_argument(
        "--with-ours",
        action="store_true",
        help="the bench's own rows of ours too (same microbatches as PEFT; ~1 min per shape)",
    )
    parser.add_argument("--write-data", type=Path, help="only write the jobs' data there")
    args = parser.parse_args(argv)
    if args.write_data:
        write_data(args.write_data)
        return
    args.out = args.out.resolve()
    write_data(args.out / "data")
    _check(args.shapes)
    train = {shape: _train(shape, args) for shape in args.shapes}
    for shape, row in train.items():
        print(f"# lorafusion train {shape}: {row}", flush=True)
    bench = _bench(args.shapes, args)
    _print_summary(train, bench, args)


if __name__ == "__main__":
    main()
