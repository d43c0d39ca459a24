"""Plans to and from JSON, so `lorafusion plan` output can be inspected, diffed and reused."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from megatron_lorafusion.planner.types import Microbatch, Plan, Sample

__all__ = ["load_plan", "plan_from_dict", "plan_to_dict", "save_plan"]

_FORMAT = "megatron_lorafusion.plan/1"


def plan_to_dict(plan: Plan) -> dict:
    """JSON-ready dict of ``plan``.

    A microbatch is ``{"samples": [[adapter, index, tokens], ...], "finishes": [adapter]}``.
    """
    return {
        "format": _FORMAT,
        "capacity": plan.capacity,
        "tile_height": plan.tile_height,
        "num_adapters": plan.num_adapters,
        "report": asdict(plan.report) if plan.report else None,
        "microbatches": [
            {
                "samples": [[s.adapter, s.index, s.tokens] for s in mb.samples],
                "finishes": list(mb.finishes),
            }
            for mb in plan.microbatches
        ],
    }


def plan_from_dict(data: dict) -> Plan:
    """Inverse of `plan_to_dict` (the report is not restored).

    Raises:
        ValueError: if ``data`` is not a plan of this format.
    """
    if data.get("format") != _FORMAT:
        raise ValueError(f"plan format must be {_FORMAT!r}, got {data.get('format')!r}")
    mbs = tuple(
        Microbatch(
            tuple(Sample(int(a), int(i), int(t)) for a, i, t in mb["samples"]),
            tuple(int(a) for a in mb["finishes"]),
        )
        for mb in data["microbatches"]
    )
    return Plan(mbs, int(data["capacity"]), int(data["tile_height"]), int(data["num_adapters"]))


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` as JSON to ``path`` and return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan_to_dict(plan), separators=(",", ":")))
    return path


def load_plan(path: str | Path) -> Plan:
    """Read a plan written by `save_plan`.

    Raises:
        ValueError: if the file is not a plan of this format.
    """
    return plan_from_dict(json.loads(Path(path).read_text()))
