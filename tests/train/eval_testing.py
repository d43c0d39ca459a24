"""The tiny CPU job of the metrics and evaluation tests: synthetic tasks, held-out rows."""

import yaml

from megatron_lorafusion.config import JobConfig, load_config
from megatron_lorafusion.data import write_task


def eval_job(tmp_path, adapters: list[dict], steps: int, seed: int, **train) -> JobConfig:
    """A one-layer tiny model trained ``steps`` steps on CPU, 20 % of each task held out.

    ``adapters`` holds, per adapter, its ``task`` (a synthetic task, 40 rows) and any
    adapter keys that differ from rank 4, alpha 8, lr 1e-2; ``train`` overrides train keys.
    """
    entries = []
    for spec in adapters:
        spec = dict(spec)
        task = spec.pop("task")
        path = write_task(task, tmp_path / f"{task}.jsonl", 40, seed=seed)
        entries.append(
            {
                "name": task,
                "rank": 4,
                "alpha": 8,
                "lr": 1e-2,
                "eval_fraction": 0.2,
                "dataset": {"path": str(path)},
                **spec,
            }
        )
    job = {
        "model": {"preset": "tiny", "num_layers": 1},
        "adapters": entries,
        "data": {"max_seq_length": 48},
        "planner": {"solver": "greedy", "token_capacity": 96},
        "train": {"steps": steps, "device": "cpu", "output_dir": str(tmp_path / "out"), **train},
        "logging": {"progress_bar": False},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return load_config(path)
