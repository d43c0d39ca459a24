import subprocess
import sys


def test_planner_imports_neither_torch_nor_sim():
    code = (
        "import sys, megatron_lorafusion.planner; "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] == 'torch' or m.startswith(('megatron.', 'megatron_lorafusion.sim'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
