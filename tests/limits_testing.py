"""Run the `lorafusion` program in a child process under a memory limit (issue 36).

A check that lets a huge count or an alias bomb through would otherwise swap or OOM the
machine running the suite; under ``RLIMIT_AS`` it fails at once with a `MemoryError`.
"""

import subprocess
import sys

_LIMITED = """
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.argv = ["lorafusion", *sys.argv[2:]]
from megatron_lorafusion.__main__ import run
raise SystemExit(run())
"""

GiB = 1 << 30


def run_limited(argv: list[str], memory: int, cwd=None, timeout: float = 120.0):
    """``lorafusion *argv`` with at most ``memory`` bytes of address space; the finished
    process (``returncode``, ``stdout``, ``stderr`` as text)."""
    return subprocess.run(
        [sys.executable, "-c", _LIMITED, str(memory), *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )
