"""Training: jobs, the session loop, the adapters' fused optimizer, checkpoints and export.

`main.main` wires a job file: one `job.AdapterJob` per adapter, trained by a
`session.Session` on one `recipe.Run` (the engine: `pipeline.run_pipeline`, one process being
its ``PP = DP = 1`` case), each adapter saved on its own (`checkpoint`, `saving`, `writer`) and
exported as a PEFT folder as soon as it is done. `AdapterRun` is re-exported from `pipeline`.
"""

from megatron_lorafusion.pipeline import AdapterRun
from megatron_lorafusion.train.checkpoint import (
    AdapterCheckpoints,
    CheckpointError,
    Shard,
    full_adapter_tensors,
)
from megatron_lorafusion.train.export import (
    export_checkpoint,
    peft_adapter_config,
    peft_state_dict,
    write_merged_checkpoint,
    write_peft_folder,
)
from megatron_lorafusion.train.job import AdapterJob
from megatron_lorafusion.train.optim import AdapterAdamW, DivergenceError, lr_multiplier
from megatron_lorafusion.train.recipe import Run, adapter_training, build_run
from megatron_lorafusion.train.session import Session, SessionSettings
from megatron_lorafusion.train.stream import JobStream
from megatron_lorafusion.train.writer import BackgroundWriter, StagingPool, WriteError

__all__ = [
    "AdapterAdamW",
    "AdapterCheckpoints",
    "AdapterJob",
    "AdapterRun",
    "BackgroundWriter",
    "CheckpointError",
    "DivergenceError",
    "JobStream",
    "Run",
    "Session",
    "SessionSettings",
    "Shard",
    "StagingPool",
    "WriteError",
    "adapter_training",
    "build_run",
    "export_checkpoint",
    "full_adapter_tensors",
    "lr_multiplier",
    "peft_adapter_config",
    "peft_state_dict",
    "write_merged_checkpoint",
    "write_peft_folder",
]
