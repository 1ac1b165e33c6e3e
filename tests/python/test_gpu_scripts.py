"""The GPU proof scripts (benchmarks/gpu/) run only on the GPU machine, where a syntax error costs
a device call: here every Python script must compile, every shell script must parse (bash -n),
and the argparse-based ones must print their usage without a GPU."""

from __future__ import annotations

import pathlib
import py_compile
import subprocess
import sys

import pytest

GPU = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
WITH_HELP = ("ddp_check", "guard_check", "snapshot_check", "step_ab", "streams_compile_check",
             "torch_integration_check", "train_compare", "two_gpu_check", "workloads_compare")


@pytest.mark.parametrize("script", sorted(p.name for p in GPU.glob("*.py")))
def test_python_script_compiles(script, tmp_path):
    py_compile.compile(str(GPU / script), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("script", sorted(p.name for p in GPU.glob("*.sh")))
def test_shell_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", WITH_HELP)
def test_usage_without_a_gpu(name):
    proc = subprocess.run([sys.executable, str(GPU / f"{name}.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
