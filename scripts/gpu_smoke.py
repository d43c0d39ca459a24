"""GPU smoke run (one GPU, PP = 1): the demo job on CUDA (fused kernels) vs the CPU reference,
then a 1B-class random Llama for a few steps (tokens/s, peak memory).

    python -m scripts.gpu_smoke [--steps 20] [--big-steps 6]

The comparison keeps the demo's LoRA dropout: both paths draw the same Philox masks
(`ops.philox`), so the runs match step for step up to kernel rounding.
"""

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch

from megatron_lorafusion.config import load_config
from megatron_lorafusion.data import write_task
from megatron_lorafusion.train.main import main as train

REPO = Path(__file__).resolve().parents[1]
TASKS = ("reverse", "sort", "add", "upper")


def _job(workdir: Path, device: str, tag: str, extra: list[str]) -> dict[str, list[float]]:
    overrides = [f"adapters.{i}.dataset.path={workdir}/{t}.jsonl" for i, t in enumerate(TASKS)]
    overrides += [
        f"train.device={device}",
        f"train.output_dir={workdir}/{tag}-{device}",
        "train.save_every=0",
        "logging.progress_bar=false",
        "planner.solver=greedy",
    ]
    return train(load_config(REPO / "configs" / "demo.yaml", overrides + extra))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--big-steps", type=int, default=6)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # step lines, tok/s
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for task in TASKS:
            write_task(task, workdir / f"{task}.jsonl", 2000)
        steps = [f"train.steps={args.steps}"]
        cpu = _job(workdir, "cpu", "tiny", steps)
        cuda = _job(workdir, "cuda", "tiny", steps)
        print("\n## tiny model, fp32, demo dropout: CUDA (fused) vs CPU (reference)\n")
        print("| adapter | CPU loss first -> last | CUDA loss first -> last | max abs diff |")
        print("|---|---|---|---|")
        for name in cpu:
            diff = max(abs(a - b) for a, b in zip(cpu[name], cuda[name], strict=True))
            print(
                f"| {name} | {cpu[name][0]:.4f} -> {cpu[name][-1]:.4f} | "
                f"{cuda[name][0]:.4f} -> {cuda[name][-1]:.4f} | {diff:.2e} |"
            )

        big = [
            "model.preset=llama3.2-1b",
            "model.init_method_std=0.02",
            "train.precision=bf16",
            f"train.steps={args.big_steps}",
            "planner.token_capacity=16384",
            "data.max_seq_length=96",
        ] + [f"adapters.{i}.global_batch_size=256" for i in range(len(TASKS))]
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses = _job(workdir, "cuda", "1b", big)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print("\n## llama3.2-1b shape (random bf16 base), 4 adapters, PP = 1\n")
        for name, curve in losses.items():
            print(f"- {name}: loss {curve[0]:.4f} -> {curve[-1]:.4f} over {len(curve)} steps")
        print(
            f"- wall time {elapsed:.1f} s including build and planning; "
            f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        )


if __name__ == "__main__":
    main()
