"""megatron_lorafusion: fine-tune many LoRA adapters at once on one frozen Megatron-Core model."""

__version__ = "0.1.0"

__all__ = ["__version__"]
