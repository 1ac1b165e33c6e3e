"""torch's memory API answered by vramledger: memory_summary's layout byte for byte
against torch 2.11's recorded sample, the nested stats, torch patching, OOM observers' Python side.
"""

from __future__ import annotations

import json
import os
import types

import pytest

import vramledger
from vramledger import _summary

_SAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "reference",
                       "torch-2.11", "native-native.json")
_SAMPLE = os.environ.get("VRAMLEDGER_TORCH_SAMPLE", os.path.abspath(_SAMPLE))
if not os.path.exists(_SAMPLE):
    _SAMPLE = "/work/shared/reference/torch-2.11/native-native.json"

needs_sample = pytest.mark.skipif(not os.path.exists(_SAMPLE),
                                  reason=f"torch's recorded sample {_SAMPLE} is missing")


def _sample() -> dict:
    with open(_SAMPLE) as f:
        return json.load(f)


@needs_sample
def test_memory_summary_matches_torchs_sample_byte_for_byte():
    sample = _sample()
    assert _summary.format_summary(sample["memory_stats"], 0) == sample["memory_summary"]


@needs_sample
def test_abbreviated_summary_has_no_pool_rows_and_keeps_the_frame():
    text = _summary.format_summary(_sample()["memory_stats"], 0, abbreviated=True)
    assert "from large pool" not in text and "from small pool" not in text
    lines = text.splitlines()
    assert all(len(line) == 77 and line[0] == line[-1] == "|" for line in lines)
    assert len(lines) == 6 + 9 * 2 + 2 * 2 + 1


def test_units_switch_at_768_kib_and_750_thousand():
    assert _summary._format_size(768 * 1024 - 1, 768 * 1024 - 1) == "786431 B  "
    assert _summary._format_size(768 * 1024, 768 * 1024) == "   768 KiB"
    assert _summary._format_count(749_999, 749_999) == " 749999   "
    assert _summary._format_count(750_000, 750_000) == "    750 K "


def test_missing_key_raises_key_error_as_torch_does():
    with pytest.raises(KeyError):
        _summary.format_summary({"num_ooms": 0, "num_alloc_retries": 0}, 0)


@needs_sample
def test_nested_dict_has_torchs_top_level_keys():
    sample = _sample()
    nested = _summary.nest(sample["memory_stats"])
    assert sorted(nested) == sorted(sample["memory_stats_nested_top"])
    assert nested["allocated_bytes"]["all"]["current"] == \
        sample["memory_stats"]["allocated_bytes.all.current"]


def test_patch_torch_points_both_namespaces_at_vramledger():
    memory = types.ModuleType("torch.cuda.memory")
    cuda = types.ModuleType("torch.cuda")
    cuda.memory = memory
    fake_torch = types.SimpleNamespace(cuda=cuda)
    for name in vramledger._TORCH_PATCHED:
        setattr(cuda, name, lambda *a, **k: "torch")
        setattr(memory, name, lambda *a, **k: "torch")
    saved = dict(vramledger._torch_originals)
    try:
        vramledger._patch_torch(fake_torch)
        for name in vramledger._TORCH_PATCHED:
            assert getattr(cuda, name) is getattr(vramledger, name)
            assert getattr(memory, name) is getattr(vramledger, name)
    finally:
        vramledger._torch_originals.clear()
        vramledger._torch_originals.update(saved)


def test_oom_observers_are_called_in_order_and_a_failing_one_does_not_stop_the_rest(capsys):
    calls = []
    saved = list(vramledger._oom_observers)
    try:
        vramledger._oom_observers.clear()
        vramledger.attach_out_of_memory_observer(lambda *a: calls.append(("first",) + a))
        vramledger.attach_out_of_memory_observer(lambda *a: 1 / 0)
        vramledger.attach_out_of_memory_observer(lambda *a: calls.append(("last",) + a))
        vramledger._call_oom_observers(0, 2 << 30, 80 << 30, 1 << 30)
    finally:
        vramledger._oom_observers[:] = saved
    assert calls == [("first", 0, 2 << 30, 80 << 30, 1 << 30),
                     ("last", 0, 2 << 30, 80 << 30, 1 << 30)]
    assert "ZeroDivisionError" in capsys.readouterr().err
    with pytest.raises(TypeError):
        vramledger.attach_out_of_memory_observer(42)
