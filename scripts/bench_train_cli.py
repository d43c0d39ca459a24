"""What users get: `lorafusion train` itself, timed on the issues' workloads, cell by cell.

    python -m scripts.bench_train_cli --presets llama3.2-1b --adapters 1 4 16 64 \
        --global-batch 8 32 --cuda-graphs on off  # issue 33's matrix (4096 samples)
    python -m scripts.bench_train_cli --presets llama3.1-8b --adapters 64 --samples 2048 \
        --save-every 0 2                          # issue 31: saves off, then on
    python -m scripts.bench_train_cli --device cpu --presets tiny --adapters 2 --samples 64 \
        --max-seq-length 1024                     # the tiny preset's positions
    python -m scripts.bench_train_cli --presets llama3.1-8b --adapters 64 --samples 1024 \
        --from-checkpoint /tmp/bases              # start-up from a local checkpoint

Each cell writes the workload (XSum-like byte lengths lognormal(6.2, 0.55) clipped to
[64, 2000], 85 % prompt, split evenly over the adapters, at least ``--min-steps`` global
batches each; byte tokenizer, so one token per byte), runs ``python -m megatron_lorafusion
train`` in a child process (bf16, rank 16, alpha 32, dropout 0.1, default targets, token
capacity 8192, max_seq_length 2048) and reads
the run's last record in ``metrics.jsonl``: training tokens/s (between the first and the
last optimizer step: start-up and the first step's Triton compilation left out), start-up
(its phases in each cell's JSON line on stderr), first step, the tail after the last step
(saves and exports), microbatches and fill. It
also reports the checkpoint bytes per adapter saved and the run folder's peak size, then
deletes the folder (an 8B, 64-adapter job's checkpoints fill a small disk).

``--from-checkpoint DIR`` loads each preset's base from a local Hugging Face checkpoint
instead of drawing it: ``DIR/<preset>``, written once with the preset's sizes and random
bf16 weights (std 0.02, norms ones) where it has no ``config.json`` yet; the cells then set
``model.hf_path`` (with the byte tokenizer) and say ``(checkpoint)`` after the preset.
"""

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from megatron_lorafusion.config import MODEL_PRESETS, ModelConfig
from megatron_lorafusion.data import write_lengths

_SHARD_BYTES = 5 * 2**30  # the checkpoint's files, as transformers' save_pretrained splits


def _lengths(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(max(round(rng.lognormvariate(6.2, 0.55)), 64), 2000) for _ in range(count)]


def write_random_base(folder: Path, preset: str, device: str = "cpu") -> float:
    """A Llama checkpoint of ``preset``'s sizes in ``folder``, random bf16 weights.

    ``config.json``, safetensors files of at most 5 GiB and their index: what
    ``model.hf_path`` reads. Weights are normal with std 0.02 (drawn on ``device``), norm
    weights ones; one file's tensors are held at a time (70B: 141 GB in all).

    Returns:
        Seconds taken.

    Raises:
        ValueError: for a preset that is not a plain Llama (another family, biases, RoPE
            scaling).
    """
    start = time.perf_counter()
    m = ModelConfig(**MODEL_PRESETS[preset])
    if m.family != "llama" or m.add_qkv_bias or m.rope_scaling_factor is not None:
        raise ValueError(f"--from-checkpoint writes plain Llama bases; {preset!r} is not one")
    head = m.hidden_size // m.num_attention_heads
    shapes = {"model.embed_tokens.weight": (m.vocab_size, m.hidden_size)}
    for i in range(m.num_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (m.hidden_size,),
            layer + "self_attn.q_proj.weight": (m.num_attention_heads * head, m.hidden_size),
            layer + "self_attn.k_proj.weight": (m.num_query_groups * head, m.hidden_size),
            layer + "self_attn.v_proj.weight": (m.num_query_groups * head, m.hidden_size),
            layer + "self_attn.o_proj.weight": (m.hidden_size, m.num_attention_heads * head),
            layer + "post_attention_layernorm.weight": (m.hidden_size,),
            layer + "mlp.gate_proj.weight": (m.ffn_hidden_size, m.hidden_size),
            layer + "mlp.up_proj.weight": (m.ffn_hidden_size, m.hidden_size),
            layer + "mlp.down_proj.weight": (m.hidden_size, m.ffn_hidden_size),
        }
    shapes["model.norm.weight"] = (m.hidden_size,)
    if not m.tie_word_embeddings:
        shapes["lm_head.weight"] = (m.vocab_size, m.hidden_size)
    shards: list[list[str]] = [[]]  # names per file, planned first: one file drawn at a time
    size = 0
    for name, shape in shapes.items():
        if size and size + 2 * math.prod(shape) > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += 2 * math.prod(shape)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device).manual_seed(m.init_seed)
    weight_map = {}
    for i, names in enumerate(shards):
        tensors = {}
        for name in names:
            shape = shapes[name]
            if len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                drawn = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
                tensors[name] = drawn.mul_(0.02).cpu()
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": 2 * sum(math.prod(s) for s in shapes.values())}}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({**index, "weight_map": weight_map}, indent=2)
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": head,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": m.tie_word_embeddings,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))  # last: the commit mark
    return time.perf_counter() - start


def _job(
    args, folder: Path, preset: str, adapters: int, gbs: int, save_every: int, graphs: str = "auto"
) -> Path:
    per = max(args.samples // adapters, gbs * args.min_steps)
    entries = []
    for a in range(adapters):
        data = folder / "data" / f"a{a}.jsonl"
        write_lengths(data, _lengths(per, seed=1000 * adapters + a), seed=a)
        entries.append(
            {
                "name": f"a{a:02d}",
                "dataset": {"path": str(data)},
                "rank": args.rank,
                "alpha": 2 * args.rank,
                "dropout": 0.1,
                "lr": 1e-4,
                "global_batch_size": gbs,
            }
        )
    data = {"max_seq_length": args.max_seq_length}
    if args.from_checkpoint:
        model = {"hf_path": str(Path(args.from_checkpoint) / preset)}
        data["tokenizer"] = "byte"
    else:
        model = {"preset": preset}
        if preset == "tiny":
            model["num_layers"] = 1
    job = {
        "model": model,
        "adapters": entries,
        "data": data,
        "planner": {"token_capacity": args.capacity},
        "train": {
            "epochs": 1,
            "precision": "bf16" if args.device == "cuda" else "fp32",
            "device": args.device,
            "output_dir": str(folder / "run"),
            "save_every": save_every,
            "keep_last": args.keep_last,
            "save_buffer_gib": args.save_buffer_gib,
            "cuda_graphs": {"on": True, "off": False}.get(graphs, graphs),
        },
        "logging": {"progress_bar": False, "log_every": 10**6},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _cell(args, preset: str, adapters: int, gbs: int, save_every: int, graphs: str) -> dict:
    folder = Path(args.runs_dir) / f"{preset}-a{adapters}-g{gbs}-s{save_every}-{graphs}"
    shutil.rmtree(folder, ignore_errors=True)
    job = _job(args, folder, preset, adapters, gbs, save_every, graphs)
    start = time.perf_counter()
    log = folder / "train.log"  # a file, not a pipe: a full pipe would stall the run
    with log.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "megatron_lorafusion", "train", str(job)], stderr=stderr
        )
        peak = 0
        while child.poll() is None:  # the run folder's peak size on disk
            peak = max(peak, _size(folder / "run"))
            time.sleep(0.5)
    err = log.read_text(encoding="utf-8", errors="replace")
    wall = time.perf_counter() - start
    row = {
        "preset": preset + (" (checkpoint)" if args.from_checkpoint else ""),
        "adapters": adapters,
        "gbs": gbs,
        "save_every": save_every,
        "graphs": graphs,
    }
    if child.returncode != 0:
        lines = err.strip().splitlines()
        row["error"] = lines[-1] if lines else f"exit {child.returncode}"
        print(err[-4000:], file=sys.stderr)
        return row
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").open()]
    run = [r for r in records if r.get("adapter") is None][-1]
    saved = list((folder / "run" / "checkpoints").glob("*/step_*/*.safetensors"))
    per_save = [p.stat().st_size for p in saved]
    row.update(
        {
            "microbatches": run["microbatches"],
            "fill": run["fill"],
            "train_tok_s": run.get("train_tokens_per_s", math.nan),
            "startup_s": run["startup_s"],
            "first_step_s": run.get("first_step_s", math.nan),
            "train_s": run.get("train_s", math.nan),
            "end_s": run.get("end_s", math.nan),
            "wall_s": wall,
            "ckpt_gb_per_save": sum(per_save) / max(len(per_save), 1) / 1e9,
            "saves_kept": len(per_save),
            "checkpoints_written": err.count("saved checkpoint of adapter"),
            "save_wait_s": run.get("save_wait_s", math.nan),
            "peak_disk_gb": peak / 1e9,
            "graph_replays": run.get("graph_replays", 0),
            "graph_captures": run.get("graph_captures", 0),
            "peak_gpu_gib": run.get("peak_gpu_gib", math.nan),
            "startup_phases_s": run.get("startup_phases_s", {}),
        }
    )
    phase = row["first_step_s"] + row["train_s"]
    row["export_ratio"] = (phase + row["end_s"]) / phase if phase > 0 else math.nan
    print(json.dumps(row), file=sys.stderr, flush=True)
    if not args.keep_runs:
        shutil.rmtree(folder, ignore_errors=True)
    return row


def _table(rows: list[dict]) -> str:
    head = (
        "| preset | adapters | gbs | save_every | CUDA graphs | microbatches (replayed) | fill "
        "| train tok/s | start-up s "
        "| first step s | train s | after last step s | first mb→last export / training | "
        "checkpoints written | GB per checkpoint | waited for saves s | peak disk GB |\n"
        + "|---" * 17
        + "|"
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['preset']} | {r['adapters']} | {r['gbs']} | {r['save_every']} "
                f"| {r['graphs']} | error: {r['error']} |"
            )
            continue
        lines.append(
            f"| {r['preset']} | {r['adapters']} | {r['gbs']} | {r['save_every']} | "
            f"{r['graphs']} | {r['microbatches']} ({r['graph_replays']}) | "
            f"{100 * r['fill']:.0f}% | {r['train_tok_s']:,.0f} | "
            f"{r['startup_s']:.1f} | {r['first_step_s']:.1f} | {r['train_s']:.1f} | "
            f"{r['end_s']:.1f} | {r['export_ratio']:.2f} | {r['checkpoints_written']} | "
            f"{r['ckpt_gb_per_save']:.3f} | {r['save_wait_s']:.1f} | "
            f"{r['peak_disk_gb']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["llama3.2-1b"])
    parser.add_argument("--adapters", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--global-batch", nargs="+", type=int, default=[8])
    parser.add_argument("--save-every", nargs="+", type=int, default=[0])
    parser.add_argument(
        "--cuda-graphs",
        nargs="+",
        choices=("auto", "on", "off"),
        default=["auto"],
        help="train.cuda_graphs of each cell (auto, the default; on: true, off: false)",
    )
    parser.add_argument("--samples", type=int, default=4096, help="in all, split evenly")
    parser.add_argument(
        "--min-steps",
        type=int,
        default=4,
        help="each adapter gets at least this many global batches (more samples if needed: "
        "with two steps, the first comes after half the run and the rate is its second half)",
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--max-seq-length", type=int, default=2048)
    parser.add_argument("--keep-last", type=int, default=1)
    parser.add_argument(
        "--save-buffer-gib", type=float, default=None, help="default: sized to the job"
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--runs-dir", default="runs/bench_cli")
    parser.add_argument("--keep-runs", action="store_true")
    parser.add_argument(
        "--from-checkpoint",
        metavar="DIR",
        help="load each preset from a local checkpoint DIR/<preset> (written first if absent)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    for preset in args.presets if args.from_checkpoint else []:
        base = Path(args.from_checkpoint) / preset
        if not (base / "config.json").is_file():
            seconds = write_random_base(base, preset, args.device)
            print(f"wrote a random {preset} checkpoint to {base} in {seconds:.1f} s", flush=True)
    rows = [
        _cell(args, preset, adapters, gbs, save_every, graphs)
        for preset in args.presets
        for adapters in args.adapters
        for gbs in args.global_batch
        for save_every in args.save_every
        for graphs in args.cuda_graphs
    ]
    print(_table(rows))
    return rows


if __name__ == "__main__":
    main()
