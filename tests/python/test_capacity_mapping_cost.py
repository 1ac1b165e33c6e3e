"""The mapping-cost benchmark (benchmarks/capacity/mapping_cost.py) without a GPU: the timing of
batches, the probes' calls, the runs in rotating order, the table and its growth per 1,000
blocks, and the command's errors."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.capacity import mapping_cost  # noqa: E402


def test_a_batchs_time_per_call_is_the_median_over_batches_drained_outside_the_span():
    now = [0.0]
    log = []

    def clock():
        return now[0]

    def call(i):
        log.append(i)
        now[0] += 2e-6 if i < 10 else 5e-6  # the first two batches of 5 calls: 2 us a call

    def drain():
        log.append("drain")
        now[0] += 1e-3  # timed apart: 1,000 us a drain
    us, drain_us = mapping_cost.time_batches(call, drain, batch=5, repeats=5, clock=clock)
    assert us == pytest.approx(5.0)  # batches of 2, 2, 5, 5, 5 us a call
    assert drain_us == pytest.approx(1000.0)
    assert log[:8] == ["drain", 0, 1, 2, 3, 4, "drain", 5] and log.count("drain") == 6
    assert [x for x in log if x != "drain"] == list(range(25))  # i counts on across batches


class Runtime:
    """A stand-in for libcudart: records each call's name and pointers, answers `rc`."""

    def __init__(self, rc: int = 0):
        self.calls = []
        self.rc = rc

    def cudaGetDevice(self, device):
        self.calls.append(("device",))
        return self.rc

    def cudaPointerGetAttributes(self, attr, ptr):
        self.calls.append(("attr", ptr.value))
        return self.rc

    def cudaMemsetAsync(self, ptr, value, size, stream):
        self.calls.append(("memset", ptr.value, size.value))
        return self.rc

    def cudaMemcpyAsync(self, dst, src, size, kind, stream):
        self.calls.append(("memcpy", dst.value, src.value, kind))
        return self.rc


class Block:
    def __init__(self, ptr: int):
        self.ptr = ptr
        self.adds = 0

    def data_ptr(self) -> int:
        return self.ptr

    def add_(self, x):
        self.adds += x


def test_the_probes_visit_the_blocks_shuffled_so_neighbours_in_memory_are_not_consecutive():
    rt = Runtime()
    # Three blocks per segment, as torch carves 6 MiB blocks out of 20 MiB segments.
    blocks = [Block((0x100 + segment << 20) + 0x1000 * k) for segment in range(8)
              for k in range(3)]
    scalar = Block(0x10)
    calls = mapping_cost.probes(rt, blocks, scalar)
    assert set(calls) == set(mapping_cost.PROBES)
    n = len(blocks)
    for i in range(n):
        calls["ptr_attr"](i)
    visited = [c[1] for c in rt.calls]
    assert sorted(visited) == sorted(b.ptr for b in blocks)  # each block once a cycle
    same_segment = sum(a >> 20 == b >> 20 for a, b in zip(visited, visited[1:]))
    assert same_segment <= 5  # in allocation order: 16 of the 23 (the seeded order: 4)
    rt.calls.clear()
    calls["memcpy"](0)
    (_, dst, src, kind), = rt.calls
    assert dst == visited[0] and src == visited[n // 2] and dst >> 20 != src >> 20
    assert kind == mapping_cost.MEMCPY_DEVICE_TO_DEVICE
    rt.calls.clear()
    calls["control"](0)
    calls["memset"](1)
    calls["launch"](0)
    assert rt.calls == [("device",), ("memset", visited[1], 256)] and scalar.adds == 1
    # With fewer than two blocks the calls use the scalar's storage.
    rt.calls.clear()
    mapping_cost.probes(rt, [], scalar)["memcpy"](0)
    assert rt.calls == [("memcpy", 0x10, 0x10, mapping_cost.MEMCPY_DEVICE_TO_DEVICE)]
    with pytest.raises(RuntimeError, match="cudaMemsetAsync failed: CUDA error 700"):
        mapping_cost.probes(Runtime(rc=700), blocks, scalar)["memset"](0)


def test_the_runtime_is_the_one_the_process_loaded_or_none(monkeypatch):
    with pytest.raises(OSError, match="no libcudart"):
        mapping_cost.cudart("7f00-7f01 r-xp 0 0:0 0 /usr/lib/libc.so.6\n")
    monkeypatch.setattr(mapping_cost.ctypes, "CDLL", lambda path: ("lib", path))
    maps = ("7f00-7f01 r-xp 0 0:0 0 /usr/lib/libc.so.6\n"
            "7f02-7f03 r-xp 0 0:0 0 /venv/my libs/cu13/libcudart.so.13 (deleted)\n")
    assert mapping_cost.cudart(maps) == (("lib", "/venv/my libs/cu13/libcudart.so.13"),
                                         "/venv/my libs/cu13/libcudart.so.13")


def test_the_child_measures_each_count_keeps_its_blocks_and_stops_where_the_card_is_full(
        monkeypatch):
    """child() on stand-ins for torch's CUDA calls and the runtime."""
    torch = pytest.importorskip("torch")
    made = []
    empty = torch.empty

    def cuda_empty(n, dtype=None, device=None):
        if len(made) == 5:
            raise torch.OutOfMemoryError("CUDA out of memory")
        made.append(n)
        return empty(n, dtype=dtype)
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "empty", cuda_empty)
    monkeypatch.setattr(torch, "zeros", lambda n, device=None: real_zeros(n))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(torch.cuda, "memory_stats",
                        lambda: {"num_device_alloc": len(made),
                                 "reserved_bytes.all.current": len(made) << 20})
    monkeypatch.setattr(mapping_cost, "cudart", lambda: (Runtime(), "/x/libcudart.so.13"))
    monkeypatch.setattr(mapping_cost, "BATCH", 3)
    monkeypatch.setattr(mapping_cost, "time_batches",
                        lambda call, drain: (call(0), drain(), (1.0, 2.0))[-1])
    r = mapping_cost.child("torch", [4, 0, 2, 8], 1)
    assert [a["blocks"] for a in r["at"]] == [0, 2, 4] and r["oom"] == 8
    assert made == [1 << 20] * 5  # the blocks of a count stay for the next
    assert r["at"][2]["num_device_alloc"] == 4 and r["at"][2]["reserved_bytes"] == 4 << 20
    assert r["at"][1]["us"] == {p: 1.0 for p in mapping_cost.PROBES}
    assert r["at"][1]["drain_us"] == {p: 2.0 for p in mapping_cost.PROBES}
    assert r["cudart"] == "/x/libcudart.so.13" and "cu_mem_map" not in r["at"][0]


def at(blocks: int, base: float, per_1000: float, allocs: int, maps: int | None = None) -> dict:
    """A count's figures: every probe `base` us plus `per_1000` us per 1,000 blocks."""
    point = {"blocks": blocks, "num_device_alloc": allocs, "reserved_bytes": blocks * (6 << 20),
             "us": {p: base + per_1000 * blocks / 1000 for p in mapping_cost.PROBES},
             "drain_us": {p: 10.0 for p in mapping_cost.PROBES}}
    if maps is not None:
        point["cu_mem_map"] = maps
    return point


def test_the_table_gives_each_count_and_each_probes_growth_per_1000_blocks():
    runs = [{"variant": "torch", "round": r, "ok": True,
             "at": [at(0, 50.0, 0.5, 1), at(1024, 5.0, 0.5, 342), at(2048, 5.0, 0.5, 683)]}
            for r in range(2)]
    runs += [{"variant": "default", "round": r, "ok": True,
              "at": [at(0, 5.0 + r, 2.0, 1, 0), at(1024, 5.0 + r, 2.0, 1024, 1024),
                     at(2048, 5.0 + r, 2.0, 2048, 2048)]}
             for r in range(2)]
    runs.append({"variant": "default", "round": 2, "ok": False, "error": "exit 1"})
    text = mapping_cost.table(runs)
    lines = text.splitlines()
    assert lines[0].startswith("| variant | blocks | runs | control us | ptr_attr us |")
    assert "| torch | 1024 | 2 | 5.51 | 5.51 | 5.51 | 5.51 | 5.51 | 10 | 342 | 6.0 | - |" in lines
    assert ("| default | 2048 | 2 | 9.60 | 9.60 | 9.60 | 9.60 | 9.60 | 10 | 2048 | 12.0 | 2048 |"
            in lines)
    # The growth leaves count 0 out: torch's 50 us there (another kind of block) does not count.
    assert "| torch | 2 | +0.50 | +0.50 | +0.50 | +0.50 | +0.50 |" in lines
    assert "| default | 2 | +2.00 | +2.00 | +2.00 | +2.00 | +2.00 |" in lines
    with pytest.raises(ValueError, match="no run that measured"):
        mapping_cost.table([{"variant": "torch", "ok": False}])
    assert mapping_cost.slope([(0, 1.0)]) is None
    assert mapping_cost.slope([(0, 1.0), (2, 5.0), (4, 9.0)]) == pytest.approx(2.0)


def test_runs_rotate_write_the_file_as_they_end_and_count_failures(tmp_path):
    out = tmp_path / "m.json"
    seen = []

    def one(variant, counts, block_mib, timeout_s):
        seen.append((variant.allocator, variant.conf))
        if variant.conf == "x:1":
            return {"ok": False, "error": "exit 1"}
        return {"ok": True, "device": "H100", "at": [at(c, 5.0, 1.0, 1) for c in counts]}
    failed = mapping_cost.run_all(["torch", "default", "x:1"], 2, str(out), [0, 256], 6,
                                  600, 60, one=one, log=lambda s: None)
    assert failed == 2
    assert seen == [("torch", None), ("vramledger", None), ("vramledger", "x:1"),
                    ("vramledger", None), ("vramledger", "x:1"), ("torch", None)]
    doc = json.loads(out.read_text())
    assert doc["counts"] == [0, 256] and len(doc["runs"]) == 6
    assert {(r["variant"], r["round"]) for r in doc["runs"]} == {
        (v, r) for v in ("torch", "default", "x:1") for r in range(2)}
    # The budget ends the runs before one starts, and counts as a failure.
    assert mapping_cost.run_all(["torch"], 1, str(tmp_path / "n.json"), [0], 6, 10, 60,
                                one=one, log=lambda s: None) == 1


def test_a_variants_process_gets_its_environment(monkeypatch):
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen.update(cmd=cmd, env=env)
        return mapping_cost.subprocess.CompletedProcess(
            cmd, 0, mapping_cost.RESULT + '{"at": []}\n', "")
    monkeypatch.setattr(mapping_cost.subprocess, "run", fake_run)
    variant = mapping_cost.conf_rounds.parse_variant("expandable_page_mb:20+A=1")
    record = mapping_cost.run_child(variant, [0, 256], 6, 30.0)
    assert record["ok"] and seen["cmd"][-4:] == ["child", "vramledger", "0,256", "6"]
    assert seen["env"]["VRAMLEDGER_CONF"] == "expandable_page_mb:20" and seen["env"]["A"] == "1"
    mapping_cost.run_child(mapping_cost.conf_rounds.parse_variant("torch-expandable"), [0], 6, 30)
    assert seen["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_the_command_refuses_bad_arguments_and_names_bad_files(tmp_path, capsys):
    out = str(tmp_path / "m.json")
    (tmp_path / "old.json").write_text('{"runs": []}')
    for args, said in (
            (["run", "--variants", "torch", "--out", out, "--rounds", "0"], "--rounds"),
            (["run", "--variants", "torch", "--out", out, "--counts", "a,b"], "whole numbers"),
            (["run", "--variants", "torch", "--out", out, "--counts=-1,5"], "at least 0"),
            (["run", "--variants", "torch", "--out", out, "--block-mib", "0"], "--block-mib"),
            (["run", "--variants", "page_mb", "--out", out], "key:value"),
            (["run", "--variants", "torch", "--out", out, "--budget-s", "nan"], "--budget-s"),
            (["run", "--variants", "torch", "--out", str(tmp_path / "no" / "m.json")],
             "not a file in a folder"),
            (["run", "--variants", "torch", "--out", str(tmp_path / "old.json")],
             "old.json exists; name a new file")):
        with pytest.raises(SystemExit) as e:
            mapping_cost.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "Traceback" not in err, (args, err)
    assert not (tmp_path / "m.json").exists()
    assert mapping_cost.parse_counts("3072,0,256,0") == [0, 256, 3072]
    for name, text in (("missing.json", None), ("bad.json", "[1]"), ("none.json", '{"runs": []}')):
        if text is not None:
            (tmp_path / name).write_text(text)
        assert mapping_cost.main(["table", str(tmp_path / name)]) == 2, name
        assert name in capsys.readouterr().err
