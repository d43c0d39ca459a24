"""The frozen base model's fused memory-bound steps, plugged into Megatron's public seams.

On CUDA SwiGLU (GeGLU for Gemma 3), RoPE and the output layer's loss run our fused Triton ops
(``megatron_lorafusion.ops``); elsewhere the same modules run the ops' torch references, so
both paths compute one function. Every module asks `use_fused_kernels` (looked up on this
module at call time, so a test can switch the Triton path on under the interpreter):

- `FrozenRMSNorm`: the final norm and the per-head q/k norms (spec substitution; our
  `ops.rms_norm` on CUDA, torch's ``F.rms_norm`` elsewhere); `ResidualRMSNorm`, the layers'
  two pre-norms, also hands Megatron's layer the residual connection, whose gradient the
  norm's backward then adds in its own pass; `Fp8ResidualRMSNorm` under an FP8 base also
  quantizes its output for the FP8 linear it feeds;
- `FusedSwiGLU` / `FusedGeGLU`: MLP's activation module (``MLPSubmodules.activation_func``,
  which Megatron builds when ``config.use_te_activation_func`` is set; nothing of Transformer
  Engine is used); `Fp8SwiGLU` under an FP8 base also quantizes for the FP8 linears around it;
- `fused_loss_processor`: the ``output_processor`` hook of ``GPTModel.forward``, which
  `LoRAFusionGPTModel` passes when labels are given: per-token loss from the final hidden
  states by chunked linear cross-entropy, never the full ``(T, V)`` fp32 logits;
- RoPE: `VarlenCoreAttention` calls `apply_rope`.

The norms and the GLU activations mark their outputs with how to recompute them
(`input_rebuild`), so the LoRA wrapper of the linear they feed can rebuild its input in
backward instead of keeping it (selective recompute, ``train.recompute``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lorafusion.mcore.fp8 import Fp8ColumnParallelLinear, fp8_weight
from megatron_lorafusion.ops import (
    Fp8Weight,
    geglu,
    geglu_ref,
    grad_col_scale,
    linear_cross_entropy,
    rms_norm,
    rms_norm_residual,
    rope,
    rope_ref,
    swiglu,
    swiglu_fp8,
    swiglu_ref,
    triton_usable,
)
from megatron_lorafusion.ops.fp8_quant import mark_grad_col_scale
from megatron_lorafusion.ops.rms_norm import MAX_WIDTH

IGNORE_INDEX = -100
"""Label of tokens without loss (the fused loss gives them 0 and no gradient)."""

_REBUILD = "_lorafusion_rebuild"  # tensor attribute: (fn, source, the output's version)


def _mark_rebuildable(
    out: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], source: torch.Tensor
) -> torch.Tensor:
    """Record on ``out`` that ``fn(source)`` recomputes it bit for bit; returns ``out``.

    Only where the producer's own backward saves ``source`` (grad mode on, ``source``
    requiring grad), so rebuilding from it keeps nothing alive that would not be anyway.
    """
    if torch.is_grad_enabled() and source.requires_grad:
        setattr(out, _REBUILD, (fn, source, out._version))
    return out


def input_rebuild(
    x: torch.Tensor,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | None:
    """``(fn, source)`` with ``fn(source)`` equal to ``x`` bit for bit, or None.

    Set when `FrozenRMSNorm` (``source``: its input) or `FusedSwiGLU` (``source``: fc1's
    output) produced ``x`` in a forward with autograd on; None for any other tensor (a view,
    a TP gather, a Transformer Engine norm's output) and once ``x`` was written in place.
    ``fn`` is the producer's own forward: the same kernel on CUDA, the same reference on CPU.
    """
    mark = getattr(x, _REBUILD, None)
    if mark is None or mark[2] != x._version:
        return None
    return mark[0], mark[1]


def use_fused_kernels(x: torch.Tensor) -> bool:
    """True when the base model's Triton ops run on ``x``: a CUDA tensor, Triton importable."""
    return x.is_cuda and triton_usable(x)


class FrozenRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built like Megatron's norms, allowed under sequence parallelism.

    Megatron's torch-norm fallback (``WrappedTorchNorm``, used without Apex or Transformer
    Engine) refuses sequence parallelism because each TP rank then sees ``T / tp`` rows, so
    the weight's gradient is a partial sum needing an all-reduce it does not set up. Base
    weights here are frozen (no gradient), so the plain norm is exact; the weight carries
    Megatron's ``sequence_parallel`` mark all the same. On CUDA a frozen weight's norm runs
    `ops.rms_norm` (whole rows per program, no weight gradient); elsewhere, for rows wider
    than its kernels hold, or for a weight that learns, torch's ``F.rms_norm``.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization != "RMSNorm":
            raise NotImplementedError(f"only RMSNorm is supported, got {config.normalization}")
        # The weight in the compute dtype: with a bf16 input and an fp32 weight torch runs its
        # composite norm (an fp32 copy, pow, mean, rsqrt, two products, a cast back: 65 norms
        # took ~50 ms of an 8B microbatch's 527, device run 1 of the eighth session).
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, H]`` (or any ``(..., H)``) normalised like ``x`` (statistics in fp32).

        The output carries `input_rebuild`'s mark (recomputed from ``x``).
        """
        return _mark_rebuildable(self._normalise(x), self._normalise, x)

    def _fused(self, x: torch.Tensor) -> bool:
        return use_fused_kernels(x) and x.shape[-1] <= MAX_WIDTH and not self.weight.requires_grad

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            return rms_norm(x.contiguous(), self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class ResidualRMSNorm(FrozenRMSNorm):
    """A layer's pre-norm that also returns the residual connection: ``(output, residual)``.

    Megatron's ``TransformerLayer`` takes a norm's ``(output, residual)`` pair and adds the
    block's output to ``residual`` instead of to its input. On the fused path ``residual`` is
    the input again, returned by the norm's own autograd function (`ops.rms_norm_residual`),
    so the input's two gradients meet in the norm's backward kernel rather than in an add of
    autograd's (one per norm, 64 per Llama-8B microbatch); elsewhere it is the input itself.
    """

    quantize_output = False
    """Also write the output's e4m3 rows for the FP8 linear it feeds (`Fp8ResidualRMSNorm`)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normalised x, x)``; the first carries `input_rebuild`'s mark (from ``x``)."""
        if not self._fused(x):
            return super().forward(x), x
        quantize = self._quantizes(x)
        col_scale = None
        if quantize and torch.is_grad_enabled() and x.requires_grad:
            col_scale = grad_col_scale(x)  # set by `fp8_bias_dropout_add`
        out, residual = rms_norm_residual(
            x.contiguous(), self.weight, self.eps, quantize=quantize, grad_col_scale=col_scale
        )
        return _mark_rebuildable(out, self._normalise, x), residual

    def _quantizes(self, x: torch.Tensor) -> bool:
        packed = x.dim() != 3 or x.shape[1] == 1  # b > 1: the linear reads a tokens-major copy
        return (
            self.quantize_output
            and packed
            and not self.weight.sequence_parallel  # the linear reads a gathered copy
            and not torch.is_inference_mode_enabled()
        )


class Fp8ResidualRMSNorm(ResidualRMSNorm):
    """`ResidualRMSNorm` of an FP8 base: its kernels also quantize for the FP8 linears.

    The forward quantizes the output per row: the FP8 linear it feeds (``linear_qkv``,
    ``linear_fc1``) takes the e4m3 rows instead of reading the output again
    (`fp8_quant.take_quantized`). The input is the residual stream, the sum that
    `fp8_bias_dropout_add` marked with the weight scales of the FP8 linear added into it
    (``linear_proj``, or the layer before's ``linear_fc2``); the backward then also quantizes
    the input's gradient, which is that linear's incoming gradient, for its dX GEMM. Not under
    sequence parallelism (the linears read all-gathered or reduce-scattered copies), for a
    batch of b > 1 (tokens-major copies) or in inference mode.
    """

    quantize_output = True


def fp8_bias_dropout_add(training: bool, fused: bool) -> Callable:
    """Megatron's bias-dropout-add whose sum carries the FP8 block output's gradient scales.

    The layer's ``self_attn_bda`` / ``mlp_bda`` under an FP8 base. ``residual + x``'s gradient
    reaches ``x`` (``linear_proj``'s or ``linear_fc2``'s output) unchanged when there is no
    dropout and both share a dtype, so the weight scales the FP8 linear left on ``x``
    (`fp8_quant.mark_grad_col_scale`) are marked on the sum too: the norm that reads the sum
    (`Fp8ResidualRMSNorm`) produces that gradient and quantizes it for the linear.
    """
    add = get_bias_dropout_add(training, fused)

    def bias_dropout_add(x_with_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
        out = add(x_with_bias, residual, prob)
        x = x_with_bias[0]
        col_scale = grad_col_scale(x)
        passes_grad = prob == 0.0 or not training
        if col_scale is not None and passes_grad and out.dtype == x.dtype and out.shape == x.shape:
            mark_grad_col_scale(out, col_scale)
        return out

    return bias_dropout_add


class FusedSwiGLU(torch.nn.Module):
    """MLP activation of ``[gate | up]`` (linear_fc1's output): ``silu(gate) · up``.

    Built by Megatron's MLP as its activation module (``config.use_te_activation_func``):
    it then receives the whole ``[s, b, 2F]`` fc1 output and returns ``[s, b, F]``.
    """

    def __init__(self, config: TransformerConfig, **kwargs):
        super().__init__()
        if config.activation_func_clamp_value is not None or config.glu_linear_offset != 0.0:
            raise NotImplementedError("FusedSwiGLU has no clamp and no linear offset")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, F]`` from ``[s, b, 2F]``; carries `input_rebuild`'s mark (from ``x``)."""
        return _mark_rebuildable(self._activate(x), self._activate, x)

    @staticmethod
    def _activate(x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return swiglu(x.contiguous())
        return swiglu_ref(x)


class Fp8SwiGLU(FusedSwiGLU):
    """`FusedSwiGLU` of an FP8 base (``model.base_precision: fp8``).

    On CUDA its kernels also quantize what the FP8 linears next to it would (`ops.swiglu_fp8`):
    its output for fc2, and in backward fc1's incoming gradient, with the weight scales fc1's
    output carries (`ops.grad_col_scale`). The linears take them instead of reading the
    tensors again. Values are `FusedSwiGLU`'s; elsewhere (CPU, batches of b > 1 whose fc2
    input is a copy, inference mode) it is `FusedSwiGLU`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, F]`` from ``[s, b, 2F]``, carrying its e4m3 rows and `input_rebuild`'s mark."""
        packed = x.dim() != 3 or x.shape[1] == 1  # b > 1: fc2 reads a tokens-major copy
        if not (use_fused_kernels(x) and packed) or torch.is_inference_mode_enabled():
            return super().forward(x)
        col_scale = grad_col_scale(x) if torch.is_grad_enabled() and x.requires_grad else None
        return _mark_rebuildable(swiglu_fp8(x.contiguous(), col_scale), self._activate, x)


class FusedGeGLU(FusedSwiGLU):
    """MLP activation of ``[gate | up]``: ``gelu_tanh(gate) · up`` (Gemma 3's MLP).

    Megatron's config holds ``F.gelu`` (its check of ``use_te_activation_func`` admits only
    gelu, silu and relu); this module computes the tanh approximation transformers' Gemma 3
    uses (``gelu_pytorch_tanh``), not ``F.gelu``'s erf form.
    """

    @staticmethod
    def _activate(x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return geglu(x.contiguous())
        return geglu_ref(x)


def apply_rope(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate packed (T, np, d) ``query`` and (T, ng, d) ``key`` by (T, 1, d) tables."""
    if use_fused_kernels(query):
        return rope(query, key, cos, sin)
    return rope_ref(query, key, cos, sin)


def _fused_loss_applies(hidden: torch.Tensor, output_layer, weight) -> bool:
    """The fused loss covers a frozen, bias-free, unsharded (TP = 1) output layer."""
    tp_group = getattr(output_layer, "tp_group", None)
    fp8 = isinstance(weight, Fp8Weight)
    return (
        use_fused_kernels(hidden)
        and tp_group is not None
        and tp_group.size() == 1
        and not output_layer.sequence_parallel
        and getattr(output_layer, "bias", None) is None
        and (fp8 or (not weight.requires_grad and weight.dtype == hidden.dtype))
    )


def fused_loss_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor | None,
    runtime_gather_output: bool | None,
    compute_language_model_loss,
    scale_logits,
    **kwargs,
) -> torch.Tensor:
    """``GPTModel``'s ``output_processor``: per-token loss ``[b, s]`` (logits without labels).

    Args:
        hidden_states: ``[s, b, H]`` final-norm output.
        output_layer: the model's output ``ColumnParallelLinear`` (an FP8 one under an FP8
            base: its `Fp8Weight` goes to the fused loss).
        output_weight: the tied embedding weight, or None for the output layer's own.
        labels: ``[b, s]`` int64 targets, or None.
        runtime_gather_output: Megatron's flag, passed to the output layer.
        compute_language_model_loss: the model's own loss, used where the fused one does not
            apply (TP > 1: vocab-parallel; CPU: references).
        scale_logits: the model's logit scaling (MuP), applied on the unfused path.
        **kwargs: the rest of Megatron's hook arguments (unused).

    Returns:
        ``[b, s]`` fp32 per-token loss, or ``[b, s, V / tp]`` logits when ``labels`` is None.
    """
    if output_weight is None and isinstance(output_layer, Fp8ColumnParallelLinear):
        weight = fp8_weight(output_layer)
    else:
        weight = output_weight if output_weight is not None else output_layer.weight
    if labels is not None and _fused_loss_applies(hidden_states, output_layer, weight):
        seq, batch, width = hidden_states.shape
        flat = hidden_states.reshape(seq * batch, width).contiguous()  # (T, H), s-major
        targets = labels.transpose(0, 1).reshape(-1).long().contiguous()  # (T,)
        loss = linear_cross_entropy(flat, weight, targets, IGNORE_INDEX)
        return loss.view(seq, batch).transpose(0, 1).contiguous()  # [b, s]
    logits, _ = output_layer(
        hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
    )
    logits = scale_logits(logits)
    if labels is None:
        return logits.transpose(0, 1).contiguous()  # [s, b, V] -> [b, s, V]
    return compute_language_model_loss(labels, logits)


class LoRAFusionGPTModel(GPTModel):
    """Megatron's ``GPTModel`` whose loss (with ``labels``) goes through `fused_loss_processor`.

    Only the default of ``forward``'s ``output_processor`` hook changes: a caller's own
    processor wins, and multi-token prediction or inference keep Megatron's own path. With
    ``fp8_output_layer`` the output layer is an `Fp8ColumnParallelLinear` (``model.base_precision:
    fp8``; its weight is loaded like the decoder's FP8 linears).
    """

    def __init__(self, *args, fp8_output_layer: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if fp8_output_layer and self.post_process:
            if self.share_embeddings_and_output_weights:
                raise NotImplementedError("an FP8 output layer cannot share the embedding")
            self.output_layer = Fp8ColumnParallelLinear(
                self.config.hidden_size,
                self.vocab_size,
                config=self.config,
                init_method=self.config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=not self.parallel_output,
                tp_group=self.pg_collection.tp,
            )

    def forward(self, *args, output_processor=None, **kwargs):
        """``GPTModel.forward``; per-token loss ``[b, s]`` with labels, as Megatron's."""
        inference = len(args) > 5 and args[5] is not None  # positional inference_context
        if (
            output_processor is None
            and self.post_process
            and not self.config.mtp_num_layers
            and not inference
            and kwargs.get("inference_context") is None
            and kwargs.get("inference_params") is None
        ):
            output_processor = fused_loss_processor
        return super().forward(*args, output_processor=output_processor, **kwargs)
