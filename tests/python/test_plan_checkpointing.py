"""The planner with activation checkpointing (_plan.py): what a checkpointed step keeps per token,
the loss-gradient phase at the start of backward, each phase's bytes for a small model counted by
hand, and the planned peak against every checkpointed trial the H200 capacity records measured."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import pytest

from vramledger import _plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
MIB = 1 << 20
# A Llama-style model small enough to count by hand: 2 layers, hidden 8, MLP 16, vocabulary 32.
# Parameters per layer: q, k, v, o 4 x 8 x 8 + gate, up, down 3 x 8 x 16 + two RMSNorms 2 x 8 =
# 656; embedding and untied output layer 32 x 8 each, final norm 8: 2 x 656 + 256 + 256 + 8.
TINY = _plan.Model(layers=2, hidden=8, heads=2, kv_heads=2, intermediate=16, vocab=32,
                   mlp="gated", name="tiny")
TINY_PARAMS = 1832
GPT_STYLE = dataclasses.replace(TINY, mlp="gelu-tanh", tied=True, biases=True)


def phases(model, **setup):
    return _plan.estimate(model, _plan.Setup(checkpointing=True, **setup))


def test_the_tiny_model_counts_as_written():
    assert TINY.count_params() == TINY_PARAMS


@pytest.mark.parametrize("model, mixed, lora, layer_input, head_saved", [
    # fp32 residual input; RMSNorm's fp32 input + normalised input + the output layer's bf16 input
    (TINY, True, False, 4, 4 + 4 + 2),
    (TINY, False, False, 4, 4 + 4 + 4),   # fp32 training: the output layer saves fp32
    (GPT_STYLE, True, False, 4, 4 + 2),   # LayerNorm saves no normalised copy
    (TINY, True, True, 2, 4),             # LoRA: bf16 residual, frozen final norm and head
    (TINY, False, True, 4, 4),            # LoRA over an fp32 base
])
def test_checkpointed_bytes_per_token(model, mixed, lora, layer_input, head_saved):
    got = _plan.checkpointed_bytes_per_token(model, mixed, lora)
    assert got == {"layer_input": layer_input * 8, "head_saved": head_saved * 8}


def test_phases_of_a_checkpointed_step_counted_by_hand():
    p = TINY_PARAMS
    base = 4 * p + 8 * p + 64 * MIB  # fp32 weights, AdamW m and v, workspace
    T = 4 * 16
    saved = (2 * 4 * 8 + 10 * 8) * T  # L x 4 h layer inputs + 10 h by the final norm and head
    est = phases(TINY, batch=4, seq=16)
    assert est["phases"] == {
        "forward_end": base + 2 * p + saved + 10 * 32 * T,         # bf16 copies, logits and loss
        "backward_end": base + 4 * p + (31.5 * 8 + 8 * 16) * T,    # one layer recomputed
        "optimizer_step": base + 4 * p + 4 * p,                    # AdamW's foreach temporaries
        "loss_backward": base + 2 * 32 * 8 + saved + 12 * 32 * T,  # output layer's bf16 weight
    }
    assert est["peak_phase"] == "loss_backward"
    assert est["total_bytes"] == base + 512 + saved + 12 * 32 * T == 67_165_152
    assert est["activations"] == saved + 12 * 32 * T
    # One sequence of 16: the step's own state (20 B/param in the optimizer step) is the peak.
    small = phases(TINY, batch=1, seq=16)
    assert small["peak_phase"] == "optimizer_step"
    assert small["phases"]["loss_backward"] == base + 512 + (144 + 384) * 16


def test_lora_checkpointing_keeps_a_bf16_residual_stream():
    trainable = 2 * 2 * (6 * 8 + 2 * 8)  # rank 2 on q, k, v, o of both layers
    base = 2 * (TINY_PARAMS - trainable) + 4 * trainable + 8 * trainable + 64 * MIB
    T = 4 * 16
    est = phases(TINY, batch=4, seq=16, lora_rank=2)
    assert est["trainable_params"] == trainable
    assert est["phases"]["loss_backward"] == base + (2 * 2 * 8 + 4 * 8 + 12 * 32) * T
    assert est["phases"]["forward_end"] == base + 2 * trainable + (2 * 2 * 8 + 4 * 8 + 320) * T


def test_without_checkpointing_there_is_no_loss_backward_phase():
    est = _plan.estimate(TINY, _plan.Setup(batch=4, seq=16))
    assert set(est["phases"]) == {"forward_end", "backward_end", "optimizer_step"}


def test_planned_peak_matches_every_checkpointed_trial_measured():
    """The checkpointed terms are counted, not fitted: each trial that trained in the H200
    capacity records (Llama-1B with checkpointing at batch 6-60, LoRA at batch 10-42) is within
    0.2% of its planned peak allocated, at small and large batches alike."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.capacity import planner
    trials = json.loads((ROOT / "docs/results/capacity-h200-results.json").read_text())["trials"]
    checked = [(t["workload"], t["batch"], t["seq"], t["peak_allocated"]) for t in trials
               if t["workload"] in ("llama1b-ckpt", "llama1b-lora") and t.get("fits")
               and "peak_allocated" in t]
    assert len(checked) >= 15
    assert {b for w, b, _, _ in checked if w == "llama1b-ckpt"} >= {7, 9, 56, 60}
    for workload, batch, seq, measured in checked:
        ratio = measured / planner.planned_peak(workload, batch, seq)
        assert abs(ratio - 1) < 0.002, (workload, batch, seq, ratio)
