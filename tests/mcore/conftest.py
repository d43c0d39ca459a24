"""Fixtures of the mcore tests (helpers live in mcore_testing.py)."""

import pytest
from mcore_testing import TINY


@pytest.fixture
def tiny_model(megatron_single_process):
    """A frozen tiny GPTModel (TP = PP = 1), in eval mode."""
    from megatron_lorafusion.mcore import build_gpt_model

    return build_gpt_model(TINY).eval()
