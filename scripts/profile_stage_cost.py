"""Measure one Llama-3.1-8B-shaped decoder layer with 4 LoRA adapters on one GPU and write
the planner's cost profile of a pipeline stage holding 32 / S such layers.

    python -m scripts.profile_stage_cost --out-dir profiles --stages 2 4
    lorafusion simulate --lengths xsum --stages 2 --cost-profile profiles/stage_cost_s2.json

Per-layer time is the difference between a 3-layer and a 1-layer model (embedding and output
layer cancel), timed with `triton.testing.do_bench` (median) on packed bf16 microbatches;
forward alone and forward + backward give the forward and backward times.
"""

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from megatron_lorafusion.config import MODEL_PRESETS, AdapterConfig, DatasetConfig, ModelConfig
from megatron_lorafusion.mcore.parallel import (
    destroy_model_parallel,
    init_model_parallel,
    packed_seq_params,
)
from megatron_lorafusion.ops import AdapterLayout
from megatron_lorafusion.train import build_run

TOKENS = (2048, 4096, 8192)
SAMPLE_LENGTHS = (256, 1024, 2048)


def _time_microbatch(model, lora, tokens: int, length: int, device) -> tuple[float, float]:
    """(forward ms, backward ms) of one packed microbatch of ``tokens`` / ``length`` samples."""
    samples = tokens // length
    adapters_of = [i * 4 // samples for i in range(samples)]  # 4 adapters, adapter-major
    layout = AdapterLayout.from_samples(adapters_of, [length] * samples, 4, device, 1)
    ids = torch.randint(0, 32000, (1, tokens), device=device)
    pos = torch.arange(length, device=device).repeat(samples)[None]
    params = packed_seq_params(layout)
    lora.layout = layout

    def forward():
        return model(ids, pos, None, labels=ids, packed_seq_params=params)

    def forward_backward():
        forward().float().mean().backward()

    forward_backward()  # warm-up: autotune, allocator
    fwd = do_bench(forward)
    return fwd, do_bench(forward_backward) - fwd


def _time_model(layers: int, device: torch.device) -> dict[tuple[int, int], tuple[float, float]]:
    """(tokens, sample length) -> (forward ms, backward ms) of a ``layers``-layer model."""
    model_cfg = ModelConfig(**{**MODEL_PRESETS["llama3.1-8b"], "num_layers": layers})
    adapters = [
        AdapterConfig(
            name=f"a{i}", rank=16, alpha=32, dropout=0.1, dataset=DatasetConfig(path="unused")
        )
        for i in range(4)
    ]
    # Built as training builds it; one global batch each (the optimizer never steps here).
    run = build_run(
        model_cfg, adapters, [[1]] * len(adapters), device=device, params_dtype=torch.bfloat16
    )
    return {
        (tokens, length): _time_microbatch(run.model, run.lora, tokens, length, device)
        for tokens in TOKENS
        for length in SAMPLE_LENGTHS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default="profiles")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    device = torch.device("cuda")
    init_model_parallel(1, 1, device, seed=0)
    try:
        one, three = _time_model(1, device), _time_model(3, device)
    finally:
        destroy_model_parallel()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, 4 adapters r=16")
    print("| tokens | sample length | layer fwd ms | layer bwd ms |")
    print("|---|---|---|---|")
    points = []
    for key in sorted(one):
        fwd = (three[key][0] - one[key][0]) / 2
        bwd = (three[key][1] - one[key][1]) / 2
        tokens, length = key
        print(f"| {tokens} | {length} | {fwd:.3f} | {bwd:.3f} |")
        points.append(
            {
                "tokens": tokens,
                "squared_lengths": (tokens // length) * length**2,
                "forward_ms": fwd,
                "backward_ms": bwd,
            }
        )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stages in args.stages:
        layers = 32 // stages
        scaled = [
            {**p, "forward_ms": p["forward_ms"] * layers, "backward_ms": p["backward_ms"] * layers}
            for p in points
        ]
        path = out / f"stage_cost_s{stages}.json"
        path.write_text(json.dumps({"points": scaled}, indent=1) + "\n")
        print(f"wrote {path} ({layers} layers per stage)")


if __name__ == "__main__":
    main()
