"""Shared fixtures: seeding, the `gpu`/`multigpu` markers, and Megatron process groups on CPU."""

import os
import random

# The equality tests (an adapter trained alone, among others, served, resumed: <= 1e-5) hold
# results equal up to fp32 summation order, so that order must not move with where a
# sample lands in a packed microbatch. With ATen's AVX-512 CPU kernels it does on some
# machines (AMD EPYC here: one served factor 7.7e-4 off after 4 Adam steps, bitwise equal
# with the AVX2 kernels), so the tests and the processes they start use the AVX2 kernels.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
# ...and oneDNN too: on a CPU with AMX (Intel Sapphire Rapids), ATen's bf16 attention asks
# oneDNN whether to pack for AMX, then refuses to pack under the AVX2 kernels ("pack_vnni2
# is only supported when avx512 is supported").
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
# One intra-op thread per test process, and in the processes the tests start: `make test` runs
# two xdist workers on 2 cores, and two OpenMP threads in each oversubscribe them (their
# spin-waits made a CPU training test 3.6x slower beside another test: 91 s against 25 s).
_ONE_THREAD = "OMP_NUM_THREADS" not in os.environ
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if _ONE_THREAD:
    torch.set_num_threads(1)  # in case a plugin imported torch before this file


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA device; run on the GPU machine")
    no_torchrun = pytest.mark.skip(reason="needs torchrun with several GPUs (WORLD_SIZE unset)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if "multigpu" in item.keywords and "WORLD_SIZE" not in os.environ:
            item.add_marker(no_torchrun)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture
def megatron_single_process():
    """A one-process gloo world with Megatron's model-parallel groups (TP = PP = 1)."""
    from dist_testing import gloo_world

    with gloo_world() as parallel_state:
        yield parallel_state
