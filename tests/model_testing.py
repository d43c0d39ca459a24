"""The tests' base models: each is `MODEL_PRESETS["tiny"]` with explicit overrides.

The preset (2 layers, hidden 128, 4 heads in 2 groups, vocab 260) at one layer is the train
tests' model; the mcore and pipeline tests run it narrower, at the sizes, init std and seed
their tolerances were measured with.
"""

from typing import Any

from megatron_lorafusion.config import MODEL_PRESETS, ModelConfig


def tiny_model(**overrides: Any) -> ModelConfig:
    """`MODEL_PRESETS["tiny"]` as a `ModelConfig`, ``overrides`` replacing its fields."""
    return ModelConfig(**{**MODEL_PRESETS["tiny"], **overrides})


# One layer: the train tests' model (eval_testing's job runs the same preset and layers).
TRAIN_MODEL = tiny_model(num_layers=1)
# Half the width, 4 heads of 16 in 2 groups: the mcore and export tests'.
MCORE_MODEL = tiny_model(
    hidden_size=64,
    ffn_hidden_size=176,
    max_position_embeddings=256,
    init_method_std=0.02,
    init_seed=3,
)
# A quarter of the width and 4 layers, one per stage at PP = 4 (vocab 260 and 4 heads in 2
# groups divide TP = 2): the pipeline tests'.
PIPELINE_MODEL = tiny_model(
    num_layers=4,
    hidden_size=32,
    ffn_hidden_size=64,
    max_position_embeddings=64,
    init_method_std=0.02,
    init_seed=3,
)
