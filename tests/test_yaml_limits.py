"""Job files past the YAML limits (issue 36): alias bombs, self-referring aliases, deep or
huge files, and problem lists of any length, each refused in one short message."""

import pytest
from limits_testing import GiB, run_limited

from megatron_lorafusion.config import ConfigError, load_config
from megatron_lorafusion.yaml_limits import MAX_JOB_VALUES


def _job(tmp_path, adapter_extra: str = "", head: str = "") -> str:
    data = tmp_path / "a.jsonl"
    data.write_text('{"prompt": "p", "response": "r"}\n')
    return (
        head
        + "adapters:\n"
        + f"  - name: a\n    dataset: {{path: {data}}}\n"
        + adapter_extra
        + f"train: {{steps: 1, output_dir: {tmp_path / 'out'}}}\n"
    )


def _bomb(levels: int = 9, width: int = 10) -> str:
    """Anchors of anchors: ``width ** levels`` strings once expanded, in 500 bytes."""
    lines = [f"  - &b0 [{', '.join(['linear_qkv'] * width)}]"]
    lines += [f"  - &b{i} [{', '.join([f'*b{i - 1}'] * width)}]" for i in range(1, levels)]
    return "bombs:\n" + "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_naming_its_line_before_anything_is_built(tmp_path):
    """A billion values from 500 bytes: validate and train exit 2 at once under 1 GiB."""
    path = tmp_path / "job.yaml"
    text = _job(tmp_path, "    target_modules: *b8\n", head=_bomb())
    path.write_text(text)
    line = text.splitlines().index(next(q for q in text.splitlines() if "&b5" in q)) + 1
    for command in ("validate", "train"):
        done = run_limited([command, str(path)], memory=GiB)
        assert done.returncode == 2, done.stderr
        assert done.stderr == (
            f"error: invalid job config:\n  - job file {str(path)!r}, line {line}: the aliases "
            f"expand to more than {MAX_JOB_VALUES} values (each use of an alias counts every "
            f"value it stands for; a job file needs a few thousand)\n"
        )
        assert done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "job.yaml"], "nothing written"


def test_yaml_merges_and_reused_anchors_of_real_jobs_still_load(tmp_path):
    data = tmp_path / "a.jsonl"
    data.write_text('{"prompt": "p", "response": "r"}\n')
    path = tmp_path / "job.yaml"
    path.write_text(
        "adapters:\n"
        f"  - &base {{name: a, dataset: &d {{path: {data}}}, rank: 4, lr: 2.0e-4}}\n"
        "  - <<: *base\n"
        "    name: b\n"
        "    lr: 1.0e-4\n"
        "  - {name: c, dataset: *d}\n"
        f"train: {{steps: 1, output_dir: {tmp_path / 'out'}}}\n"
    )
    a, b, c = load_config(path).adapters
    assert (b.name, b.rank, b.lr, b.dataset) == ("b", 4, 1e-4, a.dataset), "merged, then set"
    assert (c.rank, c.dataset) == (8, a.dataset)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("train: &a [*a]\n", "line 1: alias *a is inside the collection it names"),
        ("train: {steps: *nowhere}\n", "line 1: found undefined alias *nowhere"),
        ("a: " + "[" * 70 + "]" * 70 + "\n", "line 1: nested too deeply (more than 64 levels)"),
    ],
)
def test_yaml_alias_and_nesting_problems_are_named(tmp_path, text, problem):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"job file {str(path)!r}, {problem}"]


def test_yaml_file_over_the_limit_is_refused_before_parsing(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("train:\n" + "  # padding\n" * 500_000)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        f"job file {str(path)!r} must be at most 4 MiB (a job file is a few KB), got 5.7 MiB"
    ]


def test_yaml_override_with_an_alias_bomb_is_refused(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(_job(tmp_path))
    bomb = "[" + ", ".join(["&x0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + ["*x0"] * 9) + "]"
    for i in range(1, 6):
        bomb = f"[&x{i} {bomb}, " + ", ".join([f"*x{i}"] * 9) + "]"
    with pytest.raises(ConfigError, match=r"override 'train\.steps=.*the aliases expand to more"):
        load_config(path, [f"train.steps={bomb}"])


def test_config_problem_list_is_capped_with_a_count_of_the_rest(tmp_path):
    """900,000 unknown keys printed 128 MB of errors; the message now shows the first 50."""
    path = tmp_path / "job.yaml"
    keys = "".join(f"  k{i}: 1\n" for i in range(20_000))
    path.write_text(
        _job(tmp_path).replace("train: {steps: 1,", "logging:\n" + keys + "train: {steps: 1,")
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 20_000, "every problem is kept for callers"
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid job config:"
    assert lines[1:3] == ["  - logging.k0 is not a known key", "  - logging.k1 is not a known key"]
    assert len(lines) == 1 + ConfigError.SHOWN + 1
    assert lines[-1] == f"  ... and {20_000 - ConfigError.SHOWN} more problems"
    long = ConfigError(["adapters.0.name must be short, got " + "x" * 10**6])
    assert len(str(long)) < 2 * ConfigError.WIDTH
    assert str(long).endswith(f"... ({10**6 + 35} characters)")
