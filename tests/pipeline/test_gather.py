"""`unshard_tp`, the one TP un-shard rule of gathers and checkpoints, and its quiet import."""

import subprocess
import sys

import pytest
import torch

from megatron_lorafusion.pipeline.gather import unshard_tp


@pytest.mark.parametrize(("tp", "stride", "dim"), [(2, 1, 0), (2, 2, 0), (2, 1, 1), (4, 2, 0)])
def test_unshard_tp_inverts_megatrons_strided_split(tp, stride, dim):
    full = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
    if dim == 1:
        full = full.T.contiguous()
    chunks = full.chunk(tp * stride, dim=dim)  # as Megatron's `_initialize_affine_weight_cpu`
    shards = [torch.cat(chunks[r::tp], dim=dim) for r in range(tp)]
    torch.testing.assert_close(
        unshard_tp(shards, dim, stride),
        full,
        atol=0,
        rtol=0,
        msg="TP shards must merge back into the full tensor",
    )


def test_checkpoint_and_gather_import_no_megatron():
    code = (
        "import sys, megatron_lorafusion.train.checkpoint, megatron_lorafusion.pipeline.gather; "
        "print(sorted(m for m in sys.modules if m.startswith('megatron.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
