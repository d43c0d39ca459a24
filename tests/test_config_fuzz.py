"""Seeded fuzz of the demo job through `lorafusion validate` (issue 17 case 11).

Every mutation ends in exit 0 or exit 2 with the key named; none lets an exception escape.
"""

import copy
import random
from pathlib import Path

import yaml

from megatron_lorafusion.cli import main

REPO = Path(__file__).resolve().parents[1]
SEED, CASES = 17, 200
BAD_VALUES = ["x", None, [], {}, True, -1, 0, 10**18, 2**70, float("nan"), float("inf"),
              -float("inf"), 1e300, -1e-300, "../../escape", "", "a\0b", "{", "{0}", "é" * 300,
              [1, "a"], {"k": 1}, "cuda", "auto", 3.5]
BAD_KEYS = ["rnak", "lr_", "", "0", "x.y", "model"]


def _leaves(node, at=()):
    """Every (path, value) of a YAML tree, sections and lists included."""
    yield at, node
    items = node.items() if isinstance(node, dict) else (
        enumerate(node) if isinstance(node, list) else ())
    for key, value in items:
        yield from _leaves(value, (*at, key))


def _set(root, at, value):
    node = root
    for key in at[:-1]:
        node = node[key]
    node[at[-1]] = value


def _mutations(job):
    rng = random.Random(SEED)
    for _ in range(CASES):
        mutated = copy.deepcopy(job)
        paths = [at for at, _ in _leaves(mutated) if at]
        for _ in range(rng.choice((1, 1, 2, 3))):
            kind = rng.random()
            at = rng.choice(paths)
            if kind < 0.8:
                _set(mutated, at, copy.deepcopy(rng.choice(BAD_VALUES)))
            else:
                sections = [a for a, v in _leaves(mutated) if isinstance(v, dict)]
                where = rng.choice(sections)
                node = mutated
                for key in where:
                    node = node[key]
                node[rng.choice(BAD_KEYS)] = rng.choice(BAD_VALUES[:8])
            paths = [a for a, _ in _leaves(mutated) if a]
        yield mutated


def test_config_fuzz_demo_job_exits_0_or_2_naming_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for adapter in job["adapters"]:
        Path(adapter["dataset"]["path"]).parent.mkdir(parents=True, exist_ok=True)
        Path(adapter["dataset"]["path"]).write_text('{"prompt": "p", "response": "r"}\n')
    path = tmp_path / "job.yaml"
    failures = []
    for i, mutated in enumerate(_mutations(job)):
        path.write_text(yaml.safe_dump(mutated, allow_unicode=True))
        try:
            status = main(["validate", str(path)])
        except BaseException as err:  # noqa: BLE001 - any escape is the failure reported
            failures.append(f"case {i}: {type(err).__name__}: {err}")
            continue
        err = capsys.readouterr().err
        if status not in (0, 2):
            failures.append(f"case {i}: exit {status}\n{err}")
        elif status == 2 and not ("must" in err or "." in err):
            failures.append(f"case {i}: exit 2 without a key named\n{err}")
        elif "Traceback" in err:
            failures.append(f"case {i}: traceback\n{err}")
    assert not (tmp_path / "runs" / "demo" / "job.json").exists(), "validate writes nothing"
    assert not failures, "\n".join(failures[:10]) + f"\n({len(failures)} of {CASES} failed)"
