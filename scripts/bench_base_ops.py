"""Fused base-model ops (RMSNorm, SwiGLU, GeGLU, RoPE, QKV split, linear cross-entropy) vs torch.

Run as ``python -m scripts.bench_base_ops`` on a GPU (Llama-3.1-8B shapes by default; ``--shape
qwen3-8b`` or ``gemma3-12b`` for theirs). The QKV split is timed without and with the per-head
q/k RMSNorm of Qwen3 and Gemma 3 (the reference then runs Megatron's two norm passes). Each
row checks the fused op against its torch reference first, then times forward + backward with
``triton.testing.do_bench`` (median, p20, p80) and reports the peak extra memory. Where
``liger_kernel`` is importable, its functional RMSNorm and fused linear cross-entropy (summed
loss, its own reduction) are timed on the same inputs (its RoPE and SwiGLU take HF's separate
layouts, so they are not compared here). RMSNorm's reference is torch's own ``F.rms_norm``.
"""

import argparse
import csv
import sys

import torch
import triton
import triton.testing

from megatron_lorafusion.config import MODEL_PRESETS, ModelConfig, attention_head_dim
from megatron_lorafusion.ops import (
    geglu,
    geglu_ref,
    linear_cross_entropy,
    linear_cross_entropy_ref,
    qkv_rope,
    qkv_rope_ref,
    rms_norm,
    rope,
    rope_ref,
    swiglu,
    swiglu_ref,
)


def _torch_rms_norm(x, weight, eps):
    """torch's fused RMSNorm (`mcore.fused_base.FrozenRMSNorm` runs `ops.rms_norm` on CUDA)."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def _cases(tokens, hidden, ffn, heads, groups, head_dim, vocab, dtype):
    dev = "cuda"
    x = torch.randn(tokens, 1, hidden, device=dev, dtype=dtype)
    w = torch.rand(hidden, device=dev, dtype=dtype) + 0.5
    fc1 = torch.randn(tokens, 1, 2 * ffn, device=dev, dtype=dtype)
    qkv = torch.randn(tokens, (heads + 2 * groups) * head_dim, device=dev, dtype=dtype)
    angles = torch.rand(tokens, 1, head_dim // 2, device=dev) * 100
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    q_norm, k_norm = (torch.rand(head_dim, device=dev, dtype=dtype) + 0.5 for _ in range(2))
    out_w = torch.randn(vocab, hidden, device=dev, dtype=dtype) / hidden**0.5
    labels = torch.randint(0, vocab, (tokens,), device=dev)
    hid = torch.randn(tokens, hidden, device=dev, dtype=dtype)

    def qk(t):
        q = t[:, : heads * head_dim].view(tokens, heads, head_dim)
        k = t[:, heads * head_dim : (heads + groups) * head_dim].view(tokens, groups, head_dim)
        return q, k

    return {
        "rms_norm": (x, lambda f, t: f(t, w, 1e-5), rms_norm, _torch_rms_norm),
        "swiglu": (fc1, lambda f, t: f(t), swiglu, swiglu_ref),
        "geglu": (fc1, lambda f, t: f(t), geglu, geglu_ref),
        "rope": (qkv, lambda f, t: f(*qk(t), cos, sin), rope, rope_ref),
        # Megatron's grouped [q… | k | v] row: split, query copy and RoPE (the reference) or
        # one kernel each way (what `mcore.PackedSelfAttention` runs).
        "qkv_rope": (
            qkv,
            lambda f, t: f(t, cos, sin, groups, heads // groups, head_dim),
            qkv_rope,
            qkv_rope_ref,
        ),
        "qkv_rope_qk_norm": (
            qkv,
            lambda f, t: f(
                t, cos, sin, groups, heads // groups, head_dim, q_norm=q_norm, k_norm=k_norm
            ),
            qkv_rope,
            qkv_rope_ref,
        ),
        "linear_cross_entropy": (
            hid,
            lambda f, t: f(t, out_w, labels),
            linear_cross_entropy,
            linear_cross_entropy_ref,
        ),
    }


def _liger_ops() -> dict:
    """Liger's functional ops by our op name, with our call signatures; empty without it."""
    try:
        from liger_kernel.transformers.functional import (
            liger_fused_linear_cross_entropy,
            liger_rms_norm,
        )
    except ImportError:
        return {}
    return {
        "rms_norm": lambda t, w, eps: liger_rms_norm(t, w, eps),
        "linear_cross_entropy": lambda t, w, labels: liger_fused_linear_cross_entropy(
            t, w, labels, reduction="sum"
        ),
    }


def _step(call, fn, leaf):
    def run():
        leaf.grad = None
        out = call(fn, leaf)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return run


def _peak(run) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--shape",
        choices=["llama3.1-8b", "qwen3-8b", "gemma3-12b"],
        default="llama3.1-8b",
        help="the sizes below default to this preset's",
    )
    parser.add_argument("--tokens", type=int, default=8192)
    for flag in ("hidden", "ffn", "heads", "groups", "head-dim", "vocab"):
        parser.add_argument(f"--{flag}", type=int)
    parser.add_argument("--csv", help="append rows to this CSV file")
    args = parser.parse_args(argv)
    preset = ModelConfig(**MODEL_PRESETS[args.shape])
    defaults = dict(
        hidden=preset.hidden_size,
        ffn=preset.ffn_hidden_size,
        heads=preset.num_attention_heads,
        groups=preset.num_query_groups,
        head_dim=attention_head_dim(preset),
        vocab=preset.vocab_size,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    dtype = torch.bfloat16
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
        f"{triton.__version__} | {args.shape} sizes | T={args.tokens} bf16, forward + backward"
    )
    liger = _liger_ops()
    print(
        "| op | ref ms | fused ms (p20-p80) | speed-up x | ref peak MiB | fused peak MiB "
        "| liger ms | liger peak MiB | liger / fused |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    cases = _cases(
        args.tokens,
        args.hidden,
        args.ffn,
        args.heads,
        args.groups,
        args.head_dim,
        args.vocab,
        dtype,
    )
    for name, (tensor, call, fused, ref) in cases.items():
        leaf = tensor.detach().clone().requires_grad_(True)
        got, want = call(fused, leaf), call(ref, leaf)
        for g, r in zip(
            got if isinstance(got, tuple) else (got,),
            want if isinstance(want, tuple) else (want,),
            strict=True,
        ):
            torch.testing.assert_close(g.float(), r.float(), atol=5e-2, rtol=2e-2)
        del got, want
        timings, peaks = {}, {}
        candidates = [("ref", ref), ("fused", fused)]
        if name in liger:
            candidates.append(("liger", liger[name]))
        for label, fn in candidates:
            run = _step(call, fn, leaf)
            timings[label] = triton.testing.do_bench(run, quantiles=[0.5, 0.2, 0.8])
            peaks[label] = _peak(run)
        ref_ms, fused_ms = timings["ref"][0], timings["fused"]
        row = [
            name,
            f"{ref_ms:.3f}",
            f"{fused_ms[0]:.3f} ({fused_ms[1]:.3f}-{fused_ms[2]:.3f})",
            f"{ref_ms / fused_ms[0]:.2f}",
            f"{peaks['ref']:.0f}",
            f"{peaks['fused']:.0f}",
        ]
        if "liger" in timings:
            liger_ms = timings["liger"][0]
            row += [f"{liger_ms:.3f}", f"{peaks['liger']:.0f}", f"{liger_ms / fused_ms[0]:.2f}"]
        else:
            row += ["-", "-", "-"]
        rows.append(row)
        print("| " + " | ".join(row) + " |")
        sys.stdout.flush()
    if args.csv:
        with open(args.csv, "a", newline="") as handle:
            csv.writer(handle).writerows(rows)


if __name__ == "__main__":
    main()
