"""The capacity benchmark's profiled trials (benchmarks/capacity/profiles.py) without a GPU: the
profiler wrapper on CPU torch, the comparison of two allocators' records, the files it reads and
the trial's flags."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.capacity import profiles, trial  # noqa: E402


class Event:
    """A stand-in for one of torch.profiler's key averages (FunctionEventAvg)."""

    def __init__(self, key, count, self_cpu, device_type="DeviceType.CPU", self_device=0.0):
        self.key, self.count, self.device_type = key, count, device_type
        self.self_cpu_time_total, self.cpu_time_total = self_cpu, self_cpu
        self.self_device_time_total = self_device


def record(allocator: str, ops_by_step: dict[int, list[tuple[str, int, float]]],
           host_us: list[float] | None = None, device_us: float = 900.0) -> dict:
    """A profiled trial record as profiles.run writes it, with host ops (name, calls, self CPU
    us) and the device rows' time per profiled step."""
    r = {"workload": "llama1b", "allocator": allocator, "cap_gib": 24.0, "dim": "batch",
         "size": 1, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "fits": True,
         "step_s": [0.6, 0.21, 0.2, 0.19, 0.1, 0.2],
         "profile": {str(i): profiles.summarize(
             [Event(n, c, cpu) for n, c, cpu in ops]
             + [Event("sm90_kernel", 1, 0.0, "DeviceType.CUDA", device_us)])
                     for i, ops in ops_by_step.items()}}
    if host_us is not None:
        r["step_host_us"] = host_us
    return r


def test_the_profiler_wrapper_summarizes_cpu_ops():
    torch = pytest.importorskip("torch")
    prof = profiles.start(torch)
    x = torch.ones(64, 64)
    for _ in range(3):
        x = x @ x / 64
    step = profiles.stop(prof)
    ops = step["ops"]
    # Every host row's self CPU time is in the total (summed in another order: a rounding apart).
    assert step["device_us"] == 0
    assert step["self_cpu_us"] >= sum(o["self_cpu_us"] for o in ops) * (1 - 1e-9)
    names = {o["name"] for o in ops}
    assert "aten::mm" in names or "aten::matmul" in names, names
    mm = next(o for o in ops if o["name"] in ("aten::mm", "aten::matmul"))
    assert mm["calls"] >= 3 and mm["self_cpu_us"] >= 0 and mm["cpu_us"] >= mm["self_cpu_us"]
    times = [o["self_cpu_us"] for o in ops]
    assert times == sorted(times, reverse=True) and len(ops) <= profiles.MAX_OPS


def test_summarize_keeps_device_time_and_gpu_waits_apart():
    step = profiles.summarize([
        Event("aten::mm", 4, 300.0, self_device=500.0),  # its kernels' time, counted again below
        Event("cudaStreamSynchronize", 2, 7000.0), Event("aten::empty", 9, 0.0),
        Event("sm90_gemm", 4, 0.0, "DeviceType.CUDA", 500.0),
        Event("Memcpy DtoH", 2, 0.0, "DeviceType.CUDA", 20.0)])
    assert (step["self_cpu_us"], step["gpu_wait_us"], step["device_us"]) == (300.0, 7000.0, 520.0)
    assert [o["name"] for o in step["ops"]] == ["cudaStreamSynchronize", "aten::mm"]
    many = profiles.summarize([Event(f"op{i}", 1, float(i + 1)) for i in range(400)])
    assert len(many["ops"]) == profiles.MAX_OPS and many["ops"][0]["name"] == "op399"
    assert many["self_cpu_us"] == sum(range(1, 401))  # every row, not the ops kept


def test_compare_lists_each_step_and_the_ops_that_differ_most():
    ours = record("vramledger", {2: [("aten::empty", 100, 5000.0), ("aten::mm", 10, 800.0),
                                     ("cudaDeviceSynchronize", 1, 9000.0)],
                                 3: [("aten::empty", 100, 7000.0)]},
                  host_us=[900.0, 80.0, 4000.0, 6000.0, 50.0, 70.0])
    theirs = record("torch", {2: [("aten::empty", 100, 1000.0), ("aten::mm", 10, 790.0)],
                              3: [("aten::empty", 100, 1500.0), ("cudaMalloc", 1, 300.0)]})
    text = profiles.compare({"vramledger": ours, "torch": theirs}, top=2)
    assert text.startswith("profiled steps of llama1b at 24 GiB, batch 1 "
                           "(NVIDIA H100 80GB HBM3, torch 2.11.0+cu130):")
    assert "| 3 | vramledger | 0.200 | 5.8 | 9.0 | 0.9 | 4.00 |" in text
    assert "| 3 | torch | 0.200 | 1.8 | 0.0 | 0.9 | - |" in text
    assert "| 6 | torch | 0.200 | - | - | - | - |" in text  # a step not profiled
    diff_rows = text.split("difference ms |\n|---|---|---|---|\n")[1].splitlines()
    # aten::empty: (5000 + 7000) - (1000 + 1500) us; then vramledger's wait for the GPU.
    assert diff_rows == ["| aten::empty | 12.00 (200) | 2.50 (200) | +9.50 |",
                         "| cudaDeviceSynchronize | 9.00 (1) | 0.00 (0) | +9.00 |"]


def test_compare_needs_vramledger_and_torch_native():
    with pytest.raises(ValueError, match="no profile of torch"):
        profiles.compare({"vramledger": record("vramledger", {})})


def test_the_compare_command_reads_a_directory(tmp_path, capsys):
    for r in (record("vramledger", {2: [("aten::add", 1, 10.0)]}),
              record("torch", {2: [("aten::add", 1, 4.0)]})):
        name = profiles.profile_name("llama1b", r["allocator"], 24.0, "batch", 1)
        (tmp_path / name).write_text(json.dumps(r))
    assert profiles.main(["compare", str(tmp_path)]) == 0
    assert "| aten::add | 0.01 (1) | 0.00 (1) | +0.01 |" in capsys.readouterr().out
    (tmp_path / "llama1b-24gib-batch1-torch.json").unlink()
    assert profiles.main(["compare", str(tmp_path)]) == 2
    assert "profiles: no profile of torch" in capsys.readouterr().err
    # Another row's profile beside them, or a second one of an allocator, is refused.
    other = record("torch", {}) | {"size": 2}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert profiles.main(["compare", str(tmp_path)]) == 2
    assert ("profiles of different rows: vramledger: llama1b 24 GiB batch 1; torch: llama1b 24 GiB "
            "batch 2") in capsys.readouterr().err
    (tmp_path / "other2.json").write_text(json.dumps(other))
    assert profiles.main(["compare", str(tmp_path)]) == 2
    assert "other2.json: a second profile of torch" in capsys.readouterr().err


def test_bad_files_and_arguments_are_refused_by_name(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{")
    assert profiles.main(["compare", str(tmp_path)]) == 2
    assert f"profiles: {bad}: not JSON" in capsys.readouterr().err
    bad.write_text('{"allocator": "cuda-malloc"}')
    assert profiles.main(["compare", str(tmp_path)]) == 2
    assert "not a profiled trial record" in capsys.readouterr().err
    for argv, says in ((["compare", str(tmp_path / "none")], "none: No such file"),
                       (["compare", str(tmp_path), "--top", "0"], "--top must be at least 1"),
                       (["run", "llama1b", "24", "batch", "0", "--out", str(tmp_path)],
                        "size must be at least 1"),
                       (["run", "gpt3", "24", "batch", "1", "--out", str(tmp_path)],
                        "invalid choice: 'gpt3'")):
        with pytest.raises(SystemExit) as e:
            profiles.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_the_trial_takes_its_flags_anywhere_after_the_shape(capsys):
    args, kwargs = trial.parse_args(["llama1b", "vramledger", "24", "1", "2048", "--profile",
                                     "--host-timing"])
    assert args == ["llama1b", "vramledger", 24.0, 1, 2048]
    assert kwargs == {"profile": True, "host_timing": True}
    args, kwargs = trial.parse_args(["gpt2m", "torch", "80", "4", "1024", "t.pickle.gz"])
    assert args[-1] == "t.pickle.gz" and kwargs == {"profile": False, "host_timing": False}
    for argv in (["gpt2m", "torch", "80", "4", "1024", "--profiles"], ["gpt2m", "torch"]):
        with pytest.raises(SystemExit) as e:
            trial.parse_args(argv)
        assert e.value.code == 2
        assert "usage: python -m benchmarks.capacity.trial" in capsys.readouterr().err
