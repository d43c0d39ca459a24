"""Training: the wiring, the adapters' fused optimizer, resumable checkpoints and PEFT export.

The engine is `megatron_lorafusion.pipeline.run_pipeline` (one process is its ``PP = DP = 1``
case); `AdapterRun` is re-exported from there.
"""

from megatron_lorafusion.pipeline import AdapterRun
from megatron_lorafusion.train.checkpoint import (
    Checkpointer,
    checkpoint_problems,
    find_resume_checkpoint,
    full_adapter_tensors,
)
from megatron_lorafusion.train.export import (
    export_checkpoint,
    peft_adapter_config,
    peft_state_dict,
    write_merged_checkpoint,
    write_peft_folder,
)
from megatron_lorafusion.train.optim import AdapterAdamW, lr_multiplier
from megatron_lorafusion.train.recipe import Run, adapter_training, build_run
from megatron_lorafusion.train.resume import ResumeSession, make_resume_session

__all__ = [
    "AdapterAdamW",
    "AdapterRun",
    "Checkpointer",
    "ResumeSession",
    "Run",
    "adapter_training",
    "build_run",
    "checkpoint_problems",
    "export_checkpoint",
    "find_resume_checkpoint",
    "full_adapter_tensors",
    "lr_multiplier",
    "make_resume_session",
    "peft_adapter_config",
    "peft_state_dict",
    "write_merged_checkpoint",
    "write_peft_folder",
]
