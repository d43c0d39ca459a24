"""The multi-adapter pipeline schedule on Megatron-Core (arrives with the pipeline issue)."""

__all__: list[str] = []
