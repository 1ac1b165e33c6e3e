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


def _workloads_compare():
    import importlib.util
    spec = importlib.util.spec_from_file_location("workloads_compare",
                                                  GPU / "workloads_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only the standard library at the top
    return module


def test_paired_step_ratio_cancels_sequence_length():
    wc = _workloads_compare()
    # Steps of very different lengths (random sequence lengths), 10% slower step for step, in
    # two rounds: the first (warm-up) step is left out.
    native = [{"step_s": [9.0, 0.2, 0.6, 0.4]}, {"step_s": [8.0, 0.3, 0.5, 0.1]}]
    slower = [{"step_s": [1.0] + [x * 1.1 for x in n["step_s"][1:]]} for n in native]
    assert wc.paired_step_ratio(slower, native) == pytest.approx(1.1)
    # A ratio of medians would say otherwise when the rounds' lengths differ.
    odd = [{"step_s": [1.0, 0.22, 0.66, 0.44]}, {"step_s": [1.0, 0.3, 0.5, 0.1]}]
    assert wc.paired_step_ratio(odd, native) == pytest.approx(1.05)


def test_paired_step_ratio_needs_two_steps():
    wc = _workloads_compare()
    with pytest.raises(ValueError, match="no steps to pair"):
        wc.paired_step_ratio([{"step_s": [1.0]}], [{"step_s": [1.0]}])
