"""Seeded fuzz of the demo job through `lorafusion validate` and `train` (issue 17 case 11).

Every mutation ends in exit 0 or exit 2 with the key named; none lets an exception escape, and
a job refused with exit 2 leaves every file as it was.
"""

import copy
import random
import re
from pathlib import Path

import yaml

from megatron_lorafusion.cli import main

REPO = Path(__file__).resolve().parents[1]
SEED, CASES = 17, 200
BAD_VALUES = [
    "x",
    None,
    [],
    {},
    True,
    -1,
    0,
    10**18,
    2**70,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e300,
    -1e-300,
    "../../escape",
    "",
    "a\0b",
    "{",
    "{0}",
    "é" * 300,
    [1, "a"],
    {"k": 1},
    "cuda",
    "auto",
    3.5,
]
# Values of the key's own type that validate may well accept, each small enough for a one-step
# train in about a second: they are what reaches the model, data and planner code.
EDGE_VALUES = {
    int: [0, 1, 2, 3, 8],
    float: [0.0, 1e-6, 0.5, 0.999, 1.0, 2.0, 1e6],
    str: [
        "x",
        "alpaca",
        "{prompt}",
        "runs/demo",
        "runs/demo/data",
        "milp",
        "linear",
        "constant",
        "bf16",
        "fp16",
        "skip",
        "reject",
        "never",
        "DEBUG",
    ],
    bool: [True, False],
    list: [["linear_fc2"], ["linear_qkv", "linear_proj"]],
}
BAD_KEYS = ["rnak", "lr_", "", "0", "x.y", "model"]


def _leaves(node, at=()):
    """Every (path, value) of a YAML tree, sections and lists included."""
    yield at, node
    items = (
        node.items()
        if isinstance(node, dict)
        else (enumerate(node) if isinstance(node, list) else ())
    )
    for key, value in items:
        yield from _leaves(value, (*at, key))


def _get(root, at):
    for key in at:
        root = root[key]
    return root


def _set(root, at, value):
    node = root
    for key in at[:-1]:
        node = node[key]
    node[at[-1]] = value


def _mutate(rng, job):
    """One random change: a bad value, a value of the key's own type, or an unknown key."""
    at = rng.choice([a for a, _ in _leaves(job) if a])
    kind, edges = rng.random(), EDGE_VALUES.get(type(_get(job, at)))
    if kind < 0.5 or (kind < 0.8 and edges is None):
        _set(job, at, copy.deepcopy(rng.choice(BAD_VALUES)))
    elif kind < 0.8:
        _set(job, at, copy.deepcopy(rng.choice(edges)))
    else:
        where = rng.choice([a for a, v in _leaves(job) if isinstance(v, dict)])
        _get(job, where)[rng.choice(BAD_KEYS)] = rng.choice(BAD_VALUES[:8])


def _mutations(job):
    rng = random.Random(SEED)
    for _ in range(CASES):
        mutated = copy.deepcopy(job)
        for _ in range(rng.choice((1, 1, 2, 3))):
            _mutate(rng, mutated)
        yield mutated


def _tree(root: Path) -> dict:
    """Every path under ``root`` with its bytes (None for a folder)."""
    return {p.relative_to(root): None if p.is_dir() else p.read_bytes() for p in root.rglob("*")}


def _run(argv, capsys):
    """(exit status, stderr) of one in-process command, or (None, the escaped exception)."""
    try:
        status = main(argv)
    except BaseException as err:  # noqa: BLE001 - any escape is the failure reported
        return None, f"{type(err).__name__}: {err}"
    return status, capsys.readouterr().err


def _problem(command, status, err):
    """Why one command's outcome is a failure of the fuzz, or None."""
    if status is None:
        return f"{command} raised {err}"
    if status not in (0, 2):
        return f"{command} exit {status}\n{err}"
    if "Traceback" in err:
        return f"{command} traceback\n{err}"
    if status == 2 and not ("must" in err or "." in err or "adapter '" in err):
        return f"{command} exit 2 without a key or adapter named\n{err}"
    return None


# A valid job whose loss, gradient or weights turned non-finite: the run stops, exports nothing.
STOPPED = re.compile(r"adapter '[^']*'.*(training stopped before that step|nothing exported)")


def _train_problems(checked, status, err, before, after):
    """What is wrong with train's outcome, given validate's and the files before and after."""
    p = []
    if checked[0] == 2:
        named = [line for line in checked[1].splitlines() if line.startswith("  - ")]
        if status != 2 or any(line not in err for line in named):
            p.append(
                f"validate exit 2 but train exit {status}, naming other problems\n"
                f"validate: {checked[1]}\ntrain: {err}"
            )
    if status == 2 and STOPPED.search(err):
        if any(f.name == "adapter_model.safetensors" for f in after.keys() - before.keys()):
            p.append(f"a stopped run exported weights\n{err}")
    elif status == 2 and after != before:
        p.append(f"train exit 2 changed files\n{err}")
    return p


def _case(tmp_path, i, mutated, job, capsys, monkeypatch):
    """Validate then train one mutation in its own folder; returns its failures."""
    root = tmp_path / f"case{i}"
    cwd = root / "cwd" / "deep"  # relative paths such as ../../escape stay under root
    for adapter in job["adapters"]:
        (cwd / adapter["dataset"]["path"]).parent.mkdir(parents=True, exist_ok=True)
        (cwd / adapter["dataset"]["path"]).write_text('{"prompt": "p", "response": "r"}\n')
    path = tmp_path / f"case{i}.yaml"
    path.write_text(yaml.safe_dump(mutated, allow_unicode=True))
    monkeypatch.chdir(cwd)
    before = _tree(root)
    checked = _run(["validate", str(path)], capsys)
    failures = [q for q in [_problem("validate", *checked)] if q is not None]
    if _tree(root) != before:
        failures.append("validate wrote files")
    status, err = _run(["train", str(path)], capsys)
    if (problem := _problem("train", status, err)) is not None:
        failures.append(problem)
    failures += _train_problems(checked, status, err, before, _tree(root))
    return [f"case {i}: {f}" for f in failures]


def test_config_fuzz_demo_job_validate_and_train_exit_0_or_2_naming_the_key(
    tmp_path, monkeypatch, capsys
):
    """Each of 200 mutations through validate and a one-step CPU train of the tiny demo model.

    Both exit 0 or 2 (never an exception or a traceback); whatever validate refuses, train
    refuses with the same problems; a train that exits 2 leaves its folder (data, output_dir,
    anything else) byte for byte as it was, except a valid job that stopped on a non-finite
    loss, gradient or weight, which exports nothing. Each case runs in its own folder, two
    levels deep so relative paths with ``..`` stay inside it. Offline: a path that is no file
    is refused, never fetched. Only the mutations validate accepts (about one in ten) build
    a model, a third of a second each: the test takes 15-30 s on 2 shared cores.
    """
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    job["train"]["steps"] = 1
    job["logging"]["progress_bar"] = False
    job["data"]["offline"] = True  # a path that is no file would be a hub name: no network
    failures = []
    for i, mutated in enumerate(_mutations(job)):
        failures += _case(tmp_path, i, mutated, job, capsys, monkeypatch)
    assert not failures, "\n".join(failures[:10]) + f"\n({len(failures)} failures, {CASES} cases)"
