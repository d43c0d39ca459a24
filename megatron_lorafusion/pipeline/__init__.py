"""The multi-adapter pipeline: pure 1F1B schedule tables and the runner that executes them."""

from megatron_lorafusion.pipeline.forward_only import forward_loss_sums
from megatron_lorafusion.pipeline.graphs import MicrobatchGraphs
from megatron_lorafusion.pipeline.groups import (
    PipelineGroups,
    check_same_across_ranks,
    make_pipeline_groups,
    one_stage_groups,
)
from megatron_lorafusion.pipeline.runner import (
    AdapterRun,
    ComputeEvent,
    StageForward,
    adapter_losses,
    gpt_stage_forward,
    run_pipeline,
    warm_up_stage,
)
from megatron_lorafusion.pipeline.schedule import (
    Action,
    LemmaError,
    data_parallel_share,
    lemma_checked,
    schedule,
    stage_actions,
)

__all__ = [
    "Action",
    "AdapterRun",
    "ComputeEvent",
    "LemmaError",
    "MicrobatchGraphs",
    "PipelineGroups",
    "StageForward",
    "adapter_losses",
    "check_same_across_ranks",
    "data_parallel_share",
    "forward_loss_sums",
    "gpt_stage_forward",
    "lemma_checked",
    "make_pipeline_groups",
    "one_stage_groups",
    "run_pipeline",
    "schedule",
    "stage_actions",
    "warm_up_stage",
]
