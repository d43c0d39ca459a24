"""docker/: the image installs exactly setup.py's runtime requirements and keeps NGC's torch.

Offline: setup.py runs with ``setuptools.setup`` captured, the Dockerfile is read as text.
"""

import runpy
import shlex
from importlib.metadata import version
from pathlib import Path

import pytest
import setuptools
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
# What each NGC PyTorch tag ships, from NVIDIA's release notes: setup.py must admit these
# builds, or pip under the image's constraints fails instead of keeping them.
NGC = {"26.02": {"torch": "2.11.0a0+eb65b36914.nv26.02", "triton": "3.6.0"}}


@pytest.fixture
def setup_kwargs(monkeypatch) -> dict:
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.chdir(REPO)  # setup.py reads README.md from the working directory
    runpy.run_path(str(REPO / "setup.py"))
    return captured


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    lines = text.replace("\\\n", " ").splitlines()
    return [tuple(line.split(None, 1)) for line in lines if line.strip()]


def _pip_installs() -> list[list[str]]:
    """Arguments of every ``pip install`` the Dockerfile runs."""
    installs = []
    for instruction, args in _instructions():
        if instruction == "RUN":
            for command in args.split("&&"):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    installs.append(words[2:])
    return installs


def _names(requirements) -> set[str]:
    return {Requirement(r).name for r in requirements}


def test_docker_requirements_are_setup_runtime_requirements(setup_kwargs):
    declared = [*setup_kwargs["install_requires"], *setup_kwargs["extras_require"]["hf"]]
    lines = (REPO / "docker" / "requirements.txt").read_text().splitlines()
    listed = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert sorted(str(Requirement(r)) for r in listed) == sorted(
        str(Requirement(r)) for r in declared
    ), "docker/requirements.txt must list setup.py's install_requires + the hf extra"
    dev_only = _names(setup_kwargs["extras_require"]["dev"]) - _names(declared)
    assert dev_only == {"pytest", "pytest-xdist", "hypothesis", "peft", "ruff"}
    assert not dev_only & _names(listed)


def test_dockerfile_installs_the_requirements_then_the_package_without_deps():
    copies = {}
    for instruction, args in _instructions():
        if instruction == "COPY":
            *sources, dest = args.split()
            copies[dest] = sources
    first, second = _pip_installs()
    requirements = first[first.index("-r") + 1]
    assert copies[requirements] == ["docker/requirements.txt"], copies
    assert [w for w in first if w.startswith("-")] == ["--no-cache-dir", "-r"], first
    assert "--no-deps" in second, "the package's own install must not resolve anything"
    assert [w for w in second if not w.startswith("-")] == ["/opt/lorafusion"], second
    for words in (first, second):  # nothing upgraded, no editable install, no extras
        assert not {"-U", "--upgrade", "--force-reinstall", "-e", "--editable"} & set(words)
        assert not any("[" in w for w in words), words


@pytest.mark.parametrize("dist", ["torch", "triton"])
def test_setup_torch_and_triton_ranges_admit_ci_and_the_ngc_image(setup_kwargs, dist):
    (spec,) = (r for r in setup_kwargs["install_requires"] if Requirement(r).name == dist)
    specifier = Requirement(spec).specifier
    (base,) = (args for instruction, args in _instructions() if instruction == "FROM")
    tag = base.removeprefix("nvcr.io/nvidia/pytorch:").removesuffix("-py3")
    for where, installed in (("this environment", version(dist)), (f"NGC {tag}", NGC[tag][dist])):
        assert specifier.contains(installed, prereleases=True), (
            f"{spec} refuses {where}'s {installed}"
        )


def test_dockerignore_keeps_runs_and_history_out_but_not_what_the_image_copies():
    ignored = {
        line.strip().rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {"runs", ".git", ".whl", ".devrun", ".device"} <= ignored
    for instruction, args in _instructions():
        if instruction == "COPY":
            for source in args.split()[:-1]:
                assert source.split("/")[0] not in ignored, f"COPY {source} is ignored"
