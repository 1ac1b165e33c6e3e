"""The GPU scripts (benchmarks/gpu/: run.sh, checks/, bench/) run only on the GPU machine, where
a syntax error costs a device call: here every Python script must compile, every shell script
must parse (bash -n), the argparse-based ones must print their usage without a GPU, and the
runner must name every check and benchmark. The figures the scripts compute from runs:
test_gpu_step_stats.py; their code paths on CPU stand-ins: test_gpu_checks_on_cpu.py."""

from __future__ import annotations

import pathlib
import py_compile
import subprocess
import sys

import pytest

GPU = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
WITH_HELP = ("checks/ddp_check", "checks/guard_check", "checks/snapshot_check",
             "checks/streams_compile_check", "checks/torch_integration_check",
             "checks/train_compare", "checks/two_gpu_check", "checks/feature_matrix/run",
             "checks/multi_gpu/run", "checks/multi_gpu/fsdp", "checks/multi_gpu/nccl_register",
             "checks/multi_gpu/ipc_pair",
             "bench/graph_step_ab", "bench/inprocess_ab", "bench/step_ab", "bench/vmm_kernel_time",
             "bench/workloads_compare", "record/record_empty_cache_trace")


def _load(path: pathlib.Path, name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", sorted(str(p.relative_to(GPU)) for p in GPU.rglob("*.py")))
def test_python_script_compiles(script, tmp_path):
    py_compile.compile(str(GPU / script), cfile=str(tmp_path / "x.pyc"), doraise=True)


@pytest.mark.parametrize("script", sorted(str(p.relative_to(GPU)) for p in GPU.rglob("*.sh")))
def test_shell_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", WITH_HELP)
def test_usage_without_a_gpu(name):
    proc = subprocess.run([sys.executable, str(GPU / f"{name}.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_ipc_check_skips_without_a_gpu():
    """ipc_check.py has no options; without a device it says SKIP and passes."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the check would run for real")
    proc = subprocess.run([sys.executable, str(GPU / "checks" / "ipc_check.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("SKIP: no CUDA device"), proc.stdout


def test_the_runner_runs_every_check_and_benchmark():
    """run.sh names every script of checks/ and bench/ (inprocess_stats.py is inprocess_ab.py's
    library, train_compare.py also the benchmarks'), so a new check cannot be left out of it."""
    runner = (GPU / "run.sh").read_text()
    scripts = [p for p in (GPU / "checks").iterdir() if p.suffix in (".py", ".sh")]
    scripts += [p for p in (GPU / "bench").glob("*.py") if p.name != "inprocess_stats.py"]
    scripts += [GPU / "checks" / "feature_matrix" / "run.py",
                GPU / "checks" / "multi_gpu" / "run.py"]
    scripts += list((GPU / "record").glob("*.py"))
    assert len(scripts) == 23, scripts  # 17 checks, 5 benchmarks, 1 recording
    missing = [str(p.relative_to(GPU)) for p in scripts if str(p.relative_to(GPU)) not in runner]
    assert not missing, f"run.sh does not run {missing}"


@pytest.mark.parametrize("item", ["guard", "preload", "multi", "ddp", "hostcost",
                                  "record_empty_cache", "capacity", "capprofile", "confrounds",
                                  "steprounds", "mapcost", "checks", "bench"])
def test_the_runner_knows_every_item(item, tmp_path):
    """An item name passes the runner's check; it then stops, since its copy's tree has no
    prepared plugin."""
    runner = tmp_path / "benchmarks" / "gpu" / "run.sh"
    runner.parent.mkdir(parents=True)
    runner.write_text((GPU / "run.sh").read_text())
    proc = subprocess.run(["bash", str(runner), item], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert "no item" not in proc.stdout, proc.stdout
    assert proc.returncode == 2 and "is missing" in proc.stdout, proc.stdout


def test_the_runner_refuses_an_unknown_item_and_prints_its_usage():
    proc = subprocess.run(["bash", str(GPU / "run.sh"), "unti"], capture_output=True, text=True)
    assert proc.returncode == 2 and "no item 'unti'" in proc.stdout
    proc = subprocess.run(["bash", str(GPU / "run.sh"), "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "bash benchmarks/gpu/run.sh prepare" in proc.stdout
