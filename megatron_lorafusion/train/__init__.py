"""Training: the adapters' fused optimizer, the loop, resumable checkpoints and PEFT export."""

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
from megatron_lorafusion.train.loop import AdapterRun, run_plan
from megatron_lorafusion.train.optim import AdapterAdamW, lr_multiplier
from megatron_lorafusion.train.resume import ResumeSession, make_resume_session

__all__ = [
    "AdapterAdamW",
    "AdapterRun",
    "Checkpointer",
    "ResumeSession",
    "checkpoint_problems",
    "export_checkpoint",
    "find_resume_checkpoint",
    "full_adapter_tensors",
    "lr_multiplier",
    "make_resume_session",
    "peft_adapter_config",
    "peft_state_dict",
    "run_plan",
    "write_merged_checkpoint",
    "write_peft_folder",
]
