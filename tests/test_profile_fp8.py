"""`scripts.profile_fp8` off the GPU: kernel categories and the per-kernel table.

The table is fed torch's own `FunctionEvent`s (built by hand, as the profiler builds them from
its trace), so the fields it reads are the installed torch's.
"""

import importlib
import re
from pathlib import Path

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

REPO = Path(__file__).resolve().parents[1]

# ops file -> the category of every Triton kernel it defines
OUR_KERNELS = {
    "fp8_quant": "fp8 quantize",
    "lora_gemm": "gemm (ours, Triton)",
    "lora_dropout": "lora",
    "lora_expand": "lora",
    "lora_shrink": "lora",
    "lora_up_bwd": "lora",
    "lora_wgrad": "lora",
    "packed_factor": "lora",
    "dora_scale": "lora",
    "linear_cross_entropy": "cross-entropy",
    "adapter_adamw": "adamw",
    "row_norms": "adamw",
}


@pytest.fixture
def profiler(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # `scripts` is a package of the repo, not installed
    return importlib.import_module("scripts.profile_fp8")


def _event(i: int, name: str, start: float, end: float, device=DeviceType.CUDA):
    return FunctionEvent(
        id=i,
        name=name,
        thread=0,
        start_us=start,
        end_us=end,
        use_device="cuda",
        device_type=device,
    )


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("_quantize_rows_kernel", "fp8 quantize"),
        ("_lora_gemm_tma_kernel", "gemm (ours, Triton)"),
        ("_lora_shrink_kernel", "lora"),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN", "gemm (cuBLAS/CUTLASS)"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm (cuBLAS/CUTLASS)"),
        (
            "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel>",
            "gemm (cuBLAS/CUTLASS)",
        ),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm (cuBLAS/CUTLASS)"),
        (
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, "
            "cutlass::bfloat16_t>>",
            "attention",
        ),
        ("_cross_entropy_fwd_kernel", "cross-entropy"),
        ("_adapter_adamw_kernel", "adamw"),
        ("_row_squared_norms_kernel", "adamw"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<>", "norm"),
        ("Memcpy DtoD (Device -> Device)", "copy/memset"),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>", "elementwise/other"),
        ("_swiglu_fwd_kernel", "elementwise/other"),
    ],
)
def test_categorise_first_matching_rule_wins(profiler, name, category):
    assert profiler._categorise(name) == category
    assert profiler._categorise(name.upper()) == category, "case-insensitive"


def test_categorise_names_every_kernel_of_our_ops(profiler):
    ops = REPO / "megatron_lorafusion" / "ops"
    for stem, category in OUR_KERNELS.items():
        kernels = re.findall(r"def (_\w+_kernel)\(", (ops / f"{stem}.py").read_text())
        assert kernels, f"no Triton kernel found in ops/{stem}.py"
        for kernel in kernels:
            assert profiler._categorise(kernel) == category, f"{stem}.py: {kernel}"


def test_kernel_table_sums_device_events_per_microbatch(profiler):
    events = [
        _event(1, "_lora_shrink_kernel", 0.0, 100.0),
        _event(2, "nvjet_tst_gemm", 50.0, 1050.0),  # overlaps the shrink (two streams)
        _event(3, "cudaLaunchKernel", 0.0, 5000.0, DeviceType.CPU),  # host side: skipped
        _event(4, "_lora_shrink_kernel", 2000.0, 2300.0),
        _event(5, "nvjet_tst_gemm", 3000.0, 4000.0),
    ]
    table = profiler._kernel_table(events, microbatches=2)
    assert [name for name, _, _ in table] == ["nvjet_tst_gemm", "_lora_shrink_kernel"]
    assert table[0][1:] == pytest.approx((1.0, 1.0)), "2000 us, 2 calls over 2 microbatches"
    assert table[1][1:] == pytest.approx((0.2, 1.0))
    by_category = profiler._category_ms(table)
    assert by_category["gemm (cuBLAS/CUTLASS)"] == pytest.approx(1.0)
    assert by_category["lora"] == pytest.approx(0.2)
    assert sum(by_category.values()) == pytest.approx(1.2)
    assert list(by_category)[-1] == "elementwise/other"
    busy, span = profiler._gpu_busy_ms(events)
    assert busy == pytest.approx((1050 + 300 + 1000) / 1e3), "the overlap counts once"
    assert span == pytest.approx(4.0)


def test_kernel_table_of_no_events_is_empty(profiler):
    assert profiler._kernel_table([]) == []
    assert profiler._gpu_busy_ms([]) == (0.0, 0.0)


def test_kernel_table_falls_back_to_the_span_where_torch_reads_zero(profiler):
    event = _event(1, "_lora_expand_kernel", 10.0, 510.0)
    event.use_device = None  # self_device_time_total is 0 then
    assert event.self_device_time_total == 0
    assert profiler._kernel_table([event]) == [("_lora_expand_kernel", pytest.approx(0.5), 1.0)]


def test_profile_tables_print_every_case_and_category(profiler, capsys):
    events = [_event(i, f"kernel_{i}", 10.0 * i, 10.0 * i + 5) for i in range(30)]
    events.append(_event(30, "_quantize_rows_kernel", 400.0, 500.0))
    result = {
        "table": profiler._kernel_table(events, 2),
        "busy_ms": 0.1,
        "span_ms": 0.25,
        "wall_ms": 0.5,
    }
    profiler._print_kernels("fp8 floor", result)
    cases = {("bf16", "floor"): result, ("fp8", "4 adapters"): result}
    profiler._print_profile_summary(cases)
    out = capsys.readouterr().out
    assert out.count("| `kernel_") == profiler.PROFILE_TOP - 1, "top 20, the quantizer first"
    assert "| `_quantize_rows_kernel` | fp8 quantize | 0.05 | 0.5 | 40.0 |" in out
    assert "| fp8 | 4 adapters | 0.1 | 0.0 |" in out
    assert "| bf16 | floor | 0.1 | 0.1 | 0.2 | 0.5 | 20 |" in out
    for category, _ in profiler.KERNEL_CATEGORIES:
        assert f" {category} |" in out


def test_short_cuts_long_kernel_names(profiler):
    assert profiler._short("void " + "k" * 100) == "k" * 67 + "..."
    assert profiler._short("a|b") == "a/b", "a pipe would break the markdown table"
