"""Training throughput on one GPU: a Llama-3.1-8B-shaped model, 4 LoRA adapters, packed bf16.

    python -m scripts.bench_train_throughput [--layers 32] [--tokens 8192] [--microbatches 8]

Times, in one process and on the same model, end-to-end forward + backward of packed
microbatches (samples of 256–2048 tokens, adapter-major, 4 adapters, r = 16, dropout 0.1,
every linear adapted) with each adapter's AdamW step after every 4 microbatches:

- ``frozen``: the base model alone (the LoRA wrappers swapped out), its embedding output
  requiring grad, so backward computes every input gradient as training would;
- ``ours``: the fused multi-LoRA path with the packed per-token RoPE (``design="auto"``);
- ``ours, design=cublas`` / ``ours, mask bits saved``: the same with the frozen GEMMs in
  cuBLAS both ways, or with the dropout mask saved as bits for the backward (docs/kernels.md);
- ``ours, Megatron THD RoPE``: the same with Megatron's per-sample RoPE loop restored.

Wall time (host included, no CUDA graphs) after a warm-up pass over the same microbatches;
tokens/s counts the packed tokens. The mission's references (same GPU, measured):
transformers + PEFT 8.6k tokens/s, 1.65× its own frozen forward + backward.
"""

import argparse
import random
import sys
import time
from unittest import mock

import torch

from megatron_lorafusion.config import MODEL_PRESETS, AdapterConfig, DatasetConfig, ModelConfig
from megatron_lorafusion.mcore import apply_lora, build_gpt_model
from megatron_lorafusion.mcore.parallel import (
    destroy_model_parallel,
    init_model_parallel,
    packed_seq_params,
)
from megatron_lorafusion.ops import AdapterLayout

ADAPTERS = 4
FUSED = sys.modules["megatron_lorafusion.ops.fused_lora_linear"]


def _always_cublas(design: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    """Stands in for `_resolve_design`: the frozen GEMMs in cuBLAS both ways."""
    return "cublas"


def _microbatch(tokens: int, vocab: int, seed: int, device) -> tuple:
    """Packed ids, positions, layout of ``tokens`` tokens: 4 adapters, samples 256–2048."""
    rng = random.Random(seed)
    lengths, adapters = [], []
    for a in range(ADAPTERS):
        left = tokens // ADAPTERS
        while left:
            n = min(left, rng.randint(min(256, left), 2048))
            lengths.append(n)
            adapters.append(a)
            left -= n
    layout = AdapterLayout.from_samples(adapters, lengths, ADAPTERS, device, seed)
    ids = torch.randint(0, vocab, (1, tokens), device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    return ids, pos, layout


def _run(model, lora, batches, optimizers, steps_every: int) -> float:
    """Seconds for forward + backward of every microbatch (and the steps), after a warm-up
    pass over the same microbatches."""

    def one(k: int, batch) -> None:
        ids, pos, layout = batch
        lora.layout = layout
        loss = model(ids, pos, None, labels=ids, packed_seq_params=packed_seq_params(layout))
        loss.float().mean().backward()
        if optimizers and (k + 1) % steps_every == 0:
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    for k, batch in enumerate(batches):  # warm-up: every layout's kernels compiled and tiled
        one(k, batch)
    _sync()
    start = time.perf_counter()
    for k, batch in enumerate(batches):
        one(k, batch)
    _sync()
    return time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _megatron_rope(model, on: bool) -> None:
    """Switch between our packed RoPE and Megatron's per-sample THD RoPE (for comparison)."""
    rotary = model.rotary_pos_emb
    if on:
        rotary.forward = lambda max_seq_len, offset=0, packed_seq=False, cp_group=None: (
            rotary.get_emb(max_seq_len, offset))
    else:
        del rotary.forward  # back to the class's method
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.rotary = None if on else rotary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per microbatch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    args = parser.parse_args()
    device = torch.device(args.device)
    init_model_parallel(1, 1, device, seed=0)
    model_cfg = ModelConfig(**{**MODEL_PRESETS["llama3.1-8b"], "num_layers": args.layers,
                               "max_position_embeddings": 8192})
    adapters = [AdapterConfig(name=f"a{i}", rank=16, alpha=32, dropout=0.1,
                              dataset=DatasetConfig(path="unused")) for i in range(ADAPTERS)]
    try:
        built = time.perf_counter()
        model = build_gpt_model(model_cfg, params_dtype=torch.bfloat16, device=device)
        lora = apply_lora(model, adapters, seed=0)
        built = time.perf_counter() - built
        with torch.no_grad():
            for a in range(ADAPTERS):
                for name, p in lora.adapter_parameters(a):
                    if name.endswith("lora_B"):  # non-zero, so every factor gets gradients
                        p.normal_(0, 0.01)
        batches = [_microbatch(args.tokens, model_cfg.vocab_size, k, device)
                   for k in range(args.microbatches)]
        optimizers = [torch.optim.AdamW([p for _, p in lora.adapter_parameters(a)], lr=1e-4)
                      for a in range(ADAPTERS)]
        results = {}
        results["ours"] = _run(model, lora, batches, optimizers, 4)
        with mock.patch.object(FUSED, "_resolve_design", _always_cublas):
            results["ours, design=cublas"] = _run(model, lora, batches, optimizers, 4)
        with mock.patch.object(FUSED, "_SAVE_MASK_BITS", True):
            results["ours, mask bits saved"] = _run(model, lora, batches, optimizers, 4)
        _megatron_rope(model, True)
        results["ours, Megatron THD RoPE"] = _run(model, lora, batches, optimizers, 4)
        _megatron_rope(model, False)
        for name, wrapper in lora.wrappers.items():  # the base linears alone
            parent, target = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), target, wrapper.base)
        hook = model.embedding.register_forward_hook(lambda m, i, out: out.requires_grad_())
        results["frozen (input grads only)"] = _run(model, lora, batches, [], 4)
        hook.remove()
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    finally:
        destroy_model_parallel()
    tokens = args.tokens * args.microbatches
    frozen = results["frozen (input grads only)"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# {name} | torch {torch.__version__} | Llama-3.1-8B shape, "
          f"{args.layers} layers, bf16, {ADAPTERS} adapters r=16 p=0.1, {args.microbatches} "
          f"microbatches x {args.tokens} tokens | build {built:.0f} s | peak {peak:.1f} GiB")
    print("| variant | s | tokens/s | time / frozen |")
    print("|---|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds:.3f} | {tokens / seconds:,.0f} | {seconds / frozen:.3f} |")


if __name__ == "__main__":
    main()
