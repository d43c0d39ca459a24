"""Training: per-adapter optimizers, the loop, checkpoints and PEFT export."""

from megatron_lorafusion.train.checkpoint import load_adapter_checkpoint, save_adapter_checkpoint
from megatron_lorafusion.train.export import peft_adapter_config, peft_state_dict, write_peft_folder
from megatron_lorafusion.train.loop import AdapterRun, run_plan
from megatron_lorafusion.train.optim import build_optimizer, lr_multiplier

__all__ = [
    "AdapterRun",
    "build_optimizer",
    "load_adapter_checkpoint",
    "lr_multiplier",
    "peft_adapter_config",
    "peft_state_dict",
    "run_plan",
    "save_adapter_checkpoint",
    "write_peft_folder",
]
