"""Share of backward time spent on LoRA weight gradients (the zero-bubble "W" pass).

    python -m scripts.bench_lora_wgrad_share [--hidden 128 512] [--tokens 512] [--repeats 7]

Times the decoder's backward on one packed microbatch with the adapter factors trainable
and frozen (input gradients flow in both, as on a middle pipeline stage); the difference
is what deferring the weight-gradient pass could move into a bubble (docs/pipeline.md).
"""

import argparse
import time

import torch
import torch.distributed as dist

from megatron_lorafusion.config import AdapterConfig, ModelConfig


def _median_backward_ms(model, lora, layout, ids, pos, trainable: bool, repeats: int) -> float:
    from megatron_lorafusion.mcore.parallel import packed_seq_params

    for p in lora.parameters():
        p.requires_grad_(trainable)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        hidden = model.embedding(ids, pos).detach().requires_grad_()
        lora.layout = layout
        model.decoder.set_input_tensor(None)
        out = model.decoder(hidden, None, packed_seq_params=packed_seq_params(layout))
        start = time.perf_counter()
        out.sum().backward()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[repeats // 2]


def main() -> None:
    from megatron.core import parallel_state

    from megatron_lorafusion.mcore import apply_lora, build_gpt_model
    from megatron_lorafusion.ops import AdapterLayout

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    print(f"CPU, 1 thread, torch {torch.__version__}, 2 layers, 3 adapters, "
          f"T = {args.tokens} in 4 samples, median of {args.repeats}")
    print("| H | R | backward ms (LoRA trainable) | backward ms (frozen) | W share |")
    print("|---|---|---|---|---|")
    try:
        for hidden in args.hidden:
            rank = 8 if hidden <= 128 else 16
            cfg = ModelConfig(num_layers=2, hidden_size=hidden, ffn_hidden_size=hidden * 11 // 4,
                              num_attention_heads=4, num_query_groups=2, vocab_size=260,
                              max_position_embeddings=args.tokens)
            model = build_gpt_model(cfg).train()
            lora = apply_lora(model, [AdapterConfig(name=f"a{i}", rank=rank, alpha=16.0)
                                      for i in range(3)], seed=0)
            quarter = args.tokens // 4
            lengths = [quarter + 50, quarter, quarter - 50, args.tokens - 3 * quarter]
            layout = AdapterLayout.from_samples([0, 0, 1, 2], lengths, 3)
            ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))
            pos = torch.cat([torch.arange(n) for n in lengths])[None]
            with_w = _median_backward_ms(model, lora, layout, ids, pos, True, args.repeats)
            without = _median_backward_ms(model, lora, layout, ids, pos, False, args.repeats)
            print(f"| {hidden} | {rank} | {with_w:.1f} | {without:.1f} | "
                  f"{100 * (with_w - without) / with_w:.1f}% |")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
