"""`vramledger plan`: a training job's GPU memory per category, per GPU, and a plan file for it.

Pure Python, no torch. This module holds the estimate (bytes per category and per phase of a
training step); the model's shape is _plan_model.py's, the plan file and table _plan_report.py's,
all re-exported here. The formulas, their sources and their calibration against measured H200
runs are in docs/design/memory-planner.md; the constants below are named there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from vramledger._plan_model import (  # noqa: F401  (re-exported: the planner's public names)
    CATEGORIES, GATED_TYPES, GB, GIB, H200_BYTES, MIB, TANH_GELU, Model, PlanError, fmt_count, gb,
    model_from_config, parse_count)
from vramledger._plan_report import (  # noqa: F401  (re-exported)
    check_plan_fractions, format_table, plan_document)

# Activation bytes per token per transformer layer under bf16/fp16 autocast with fp32 weights and
# fused (SDPA) attention: H_COEF * hidden + MLP_COEF[mlp] * intermediate. Calibrated on the
# measured H200 runs (GPT-2-medium and Llama-1B, the runs behind traces/); see
# docs/design/memory-planner.md.
H_COEF = 31.5
MLP_COEF = {"gelu-tanh": 16.0, "gated": 8.0, "gelu": 4.0}
FP32_ACTIVATION_FACTOR = 1.75  # fp32 training: not measured (docs/design/memory-planner.md)
LOGITS_BYTES_PER_VOCAB = {"mixed": 10, "fp32": 8}  # half logits + fp32 upcast + log-softmax
# The gradient of the loss at its largest, inside log_softmax's backward: the saved fp32 log-softmax
# output, its gradient (nll_loss's backward writes a dense fp32 tensor) and the gradient of its
# input, 4 V each. The loss upcasts the logits to fp32 in either precision.
LOSS_BACKWARD_BYTES_PER_VOCAB = 12
KORTHIKANTI_PER_HIDDEN = 34  # Korthikanti et al. 2022, eq. 1, no recomputation
WORKSPACE_BASE = 64 * MIB  # cuBLAS workspaces and small buffers (measured ~63-69 MB)
QLORA_BYTES_PER_PARAM = 4.127 / 8  # NF4 with double quantisation (Dettmers et al. 2023)
OPTIMIZER_BYTES = {"adamw": 8.0, "adamw-8bit": 2.0, "sgd": 4.0}  # per trainable param
OPTIMIZER_TEMP_BYTES = {"adamw": 4.0, "adamw-8bit": 0.0, "sgd": 0.0, "adafactor": 0.0}


@dataclasses.dataclass
class Setup:
    """How the model is trained."""
    seq: int = 1024
    batch: int = 1                 # micro-batch per GPU
    precision: str = "bf16-mixed"  # fp32, bf16-mixed, fp16-mixed
    optimizer: str = "adamw"       # adamw, adamw-8bit, sgd, adafactor
    checkpointing: bool = False
    lora_rank: int = 0             # 0: full fine-tuning
    lora_targets: str = "attn"     # attn (q, k, v, o) or all (also the MLP)
    qlora: bool = False            # 4-bit NF4 base weights (implies LoRA)
    zero_stage: int = 0
    gpus: int = 1
    card_bytes: int = H200_BYTES
    activation_model: str = "calibrated"  # or "korthikanti"
    eager_attention: bool = False  # attention scores materialised (no SDPA / flash)


def checkpointed_bytes_per_token(model: Model, mixed: bool, lora: bool) -> dict[str, float]:
    """What a training step with activation checkpointing (Hugging Face's
    gradient_checkpointing_enable(): one checkpoint per decoder layer) keeps per token between the
    forward and the backward, counted from the ops (docs/design/memory-planner.md, "Checkpointing").

    "layer_input": bytes one checkpointed layer keeps, its residual-stream input. The residual
    stream has the weights' dtype: fp32 with fp32 weights (under autocast the embedding is fp32
    and each residual add of fp32 and a half output is fp32, as is RMSNorm's output, weight x
    normed input), half with a half frozen base (LoRA in mixed precision). The rotary cos / sin
    are (1, s, head_dim): per sequence, not per token, so not counted.
    "head_saved": bytes the final norm and the output layer save, outside every checkpoint: the
    norm's fp32 input (LayerNorm's autocast cast, RMSNorm's .to(float32), the same tensor as the
    last layer's output when that is fp32), RMSNorm's normalised fp32 input when its weight is
    trained (the weight multiply saves it; LayerNorm's weight gradient comes from its saved input),
    and the output layer's input when its weight is trained (a half copy under autocast, fp32
    otherwise). A frozen norm and output layer (LoRA) save neither of the last two.
    """
    h = model.hidden
    half_base = lora and mixed
    head_saved = 4.0 * h
    if not lora:
        if not model.biases:  # RMSNorm (Llama-style); LayerNorm saves no normalised copy
            head_saved += 4.0 * h
        head_saved += (2.0 if mixed else 4.0) * h
    return {"layer_input": (2.0 if half_base else 4.0) * h, "head_saved": head_saved}


def estimate(model: Model, setup: Setup) -> dict[str, Any]:
    """Per-GPU bytes by category, by phase of a training step, and the planned peak.

    Returns a dict: every category name -> bytes, "total_bytes" (planned peak allocated: the
    largest phase), "phases", "formulas", "model_states_bytes", "sum_of_categories_bytes",
    "params", "trainable_params", "card_bytes", "fits", "peak_phase", "inputs", "notes".

    Raises:
      PlanError: inconsistent inputs (unknown precision or optimizer, ZeRO without GPUs, ...).
    """
    s = setup
    if s.precision not in ("fp32", "bf16-mixed", "fp16-mixed"):
        raise PlanError(f"--precision: expected fp32, bf16-mixed or fp16-mixed, got {s.precision!r}")
    if s.optimizer not in ("adamw", "adamw-8bit", "sgd", "adafactor"):
        raise PlanError(f"--optimizer: expected adamw, adamw-8bit, sgd or adafactor, got {s.optimizer!r}")
    if s.zero_stage not in (0, 1, 2, 3):
        raise PlanError(f"--zero-stage: expected 0, 1, 2 or 3, got {s.zero_stage}")
    if s.gpus < 1 or s.batch < 1 or s.seq < 1:
        raise PlanError("--gpus, --batch and --seq must be at least 1")
    if s.lora_targets not in ("attn", "all"):
        raise PlanError(f"--lora-targets: expected attn or all, got {s.lora_targets!r}")
    mixed = s.precision != "fp32"
    lora = s.lora_rank > 0 or s.qlora
    rank = s.lora_rank or (16 if s.qlora else 0)
    P = model.count_params()
    notes: list[str] = []
    F: dict[str, str] = {}

    # Trainable parameters.
    if lora:
        if not model.has_shape():
            raise PlanError("LoRA needs the model's shape (--layers, --hidden, --vocab or --config)")
        h, f, kv = model.hidden, model.ffn(), model.kv_dim()
        per_layer = rank * (6 * h + 2 * kv)
        if s.lora_targets == "all":
            per_layer += rank * (h + f) * (3 if model.mlp == "gated" else 2)
        Pt = model.layers * per_layer
        if Pt >= P:  # a rank as large as the model's dimensions: not an adapter any more
            raise PlanError(f"--lora-rank {rank}: the adapters would hold {Pt:,} parameters, as "
                            f"many as the model's {P:,} or more (its shape: {model.layers} layers "
                            f"of hidden size {h}; check the rank, and --params if given)")
    else:
        Pt = P

    # ZeRO shards (DeepSpeed's stages): 1 optimizer, 2 + gradients, 3 + weights.
    n = s.gpus
    shard_opt = n if s.zero_stage >= 1 else 1
    shard_grad = n if s.zero_stage >= 2 else 1
    shard_w = n if s.zero_stage >= 3 else 1
    zs = f" / {n} GPUs (ZeRO-{s.zero_stage})"

    # Weights: persistent copies, and the half-precision copies autocast makes for the forward
    # and backward passes (mixed precision with fp32 weights).
    if lora:
        base_bpp = QLORA_BYTES_PER_PARAM if s.qlora else (2.0 if mixed else 4.0)
        base_name = "NF4 4-bit" if s.qlora else ("bf16" if mixed else "fp32")
        w_persist = (base_bpp * (P - Pt) + 4.0 * Pt) / shard_w
        w_half = (2.0 * Pt if mixed else 0.0) / shard_w
        F["weights"] = (f"{base_bpp:.3g} B/param {base_name} frozen base x {fmt_count(P - Pt)} + "
                        f"{6 if mixed else 4} B/param LoRA adapters x {fmt_count(Pt)} (rank {rank})")
    else:
        w_persist = 4.0 * P / shard_w
        w_half = (2.0 * P if mixed else 0.0) / shard_w
        F["weights"] = (f"4 B/param fp32 weights + 2 B/param {s.precision[:4]} copies (autocast) "
                        f"= 6 B x {fmt_count(P)}" if mixed else f"4 B/param fp32 x {fmt_count(P)}")
    if shard_w > 1:
        F["weights"] += zs
    grads = 4.0 * Pt / shard_grad
    F["gradients"] = f"4 B/param fp32 x {fmt_count(Pt)} trainable" + (zs if shard_grad > 1 else "")
    if s.optimizer == "adafactor":
        if not model.has_shape():
            raise PlanError("adafactor needs the model's shape (--layers, --hidden, --vocab)")
        factored = model.layers * sum(4 * (r + c) for r, c in model.matrices())
        opt = (factored if not lora else 4.0 * 2 * math.sqrt(Pt) * model.layers) / shard_opt
        F["optimizer"] = "Adafactor factored second moments: 4 B x (rows + cols) per matrix"
    else:
        opt = OPTIMIZER_BYTES[s.optimizer] * Pt / shard_opt
        what = {"adamw": "AdamW m, v", "adamw-8bit": "8-bit AdamW m, v", "sgd": "SGD momentum"}
        F["optimizer"] = (f"{what[s.optimizer]}: {OPTIMIZER_BYTES[s.optimizer]:g} B/param x "
                          f"{fmt_count(Pt)} trainable" + (zs if shard_opt > 1 else ""))

    # Activations for one micro-batch.
    T = s.batch * s.seq
    act_saved = act_recompute = logits = loss_grad = head_half = 0.0
    if model.has_shape():
        h, f, L, V = model.hidden, model.ffn(), model.layers, model.vocab
        if s.activation_model == "korthikanti":
            per_layer = KORTHIKANTI_PER_HIDDEN * h * (2.0 if not mixed else 1.0)
            layer_text = f"{KORTHIKANTI_PER_HIDDEN} h"
        else:
            per_layer = (H_COEF * h + MLP_COEF[model.mlp] * f) * (
                1.0 if mixed else FP32_ACTIVATION_FACTOR)
            layer_text = f"({H_COEF:g} h + {MLP_COEF[model.mlp]:g} f)"
            if not mixed:
                layer_text += f" x {FP32_ACTIVATION_FACTOR:g} (fp32)"
        if s.eager_attention:
            per_layer += 5.0 * (model.heads or 1) * s.seq
            layer_text += " + 5 a s (eager attention)"
        logits = LOGITS_BYTES_PER_VOCAB["mixed" if mixed else "fp32"] * V * T
        if s.checkpointing:
            ck = checkpointed_bytes_per_token(model, mixed, lora)
            act_saved = (L * ck["layer_input"] + ck["head_saved"]) * T
            act_recompute = per_layer * T
            loss_grad = LOSS_BACKWARD_BYTES_PER_VOCAB * V * T
            head_half = 2.0 * V * h if mixed and not lora else 0.0
            F["activations"] = (
                f"checkpointing: L x {ck['layer_input'] / h:g} h B/token layer inputs + "
                f"{ck['head_saved'] / h:g} h B/token saved by the final norm and output layer, "
                f"with {LOGITS_BYTES_PER_VOCAB['mixed' if mixed else 'fp32']} V B/token logits and "
                f"loss in forward or {LOSS_BACKWARD_BYTES_PER_VOCAB} V B/token loss gradient at the "
                f"start of backward; one layer {layer_text} B/token recomputed in backward; "
                f"T = {T:,}")
        else:
            act_saved = L * per_layer * T
            F["activations"] = (f"L x {layer_text} B/token x T + "
                                f"{LOGITS_BYTES_PER_VOCAB['mixed' if mixed else 'fp32']} V B/token "
                                f"logits and loss; L = {L}, h = {h}, f = {f}, V = {V}, "
                                f"T = {s.batch} x {s.seq} = {T:,} [{s.activation_model}]")
    else:
        F["activations"] = "unknown: give --layers, --hidden and --vocab, or --config"
        notes.append("activations are not estimated without the model's shape")

    # Workspace: cuBLAS and buffers; optimizer temporaries during the step; QLoRA dequantisation.
    opt_temp = OPTIMIZER_TEMP_BYTES[s.optimizer] * Pt / shard_opt
    dequant = 0.0
    if s.qlora and model.has_shape():
        dequant = 2 * 2.0 * max(r * c for r, c in model.matrices())
    F["workspace"] = f"{WORKSPACE_BASE // MIB} MiB cuBLAS and buffers"
    if opt_temp:
        F["workspace"] += f" + foreach temporaries {OPTIMIZER_TEMP_BYTES[s.optimizer]:g} B/param in the step"
    if dequant:
        F["workspace"] += " + bf16 dequantised weights of the largest matrix (x2)"

    # Communication buffers.
    if n == 1:
        comm = 0.0
        F["communication"] = "1 GPU: none"
    elif s.zero_stage == 0:
        comm = 4.0 * Pt
        F["communication"] = "DDP gradient buckets: 4 B/param (gradient_as_bucket_view=False)"
    elif s.zero_stage in (1, 2):
        comm = 2 * min(1e9, 2.0 * Pt)
        F["communication"] = "ZeRO reduce-scatter and all-gather buckets: 2 x min(5e8 x 2 B, 2 B/param)"
    else:
        comm = 1e8 + 2 * 2.0 * P / max(model.layers or 1, 1)
        F["communication"] = "ZeRO-3 prefetch bucket 5e7 x 2 B + two gathered layers in 16 bits"

    base = w_persist + opt + WORKSPACE_BASE + comm
    phases = {"forward_end": base + w_half + act_saved + logits + dequant}
    if s.checkpointing and model.has_shape():
        # The start of backward: no gradient yet, autocast's weight cache gone with the forward's
        # autocast region except the output layer's half weight (saved by its matmul), every saved
        # activation still held, and the loss gradient in place of the forward's logits.
        phases["loss_backward"] = base + head_half + act_saved + loss_grad + dequant
    phases["backward_end"] = base + grads + act_recompute + dequant
    phases["optimizer_step"] = base + grads + opt_temp
    peak_phase = max(phases, key=phases.get)
    total = phases[peak_phase]
    cats = {
        "weights": w_persist + w_half,
        "gradients": grads,
        "optimizer": opt,
        "activations": max(act_saved + logits, act_recompute,
                           act_saved + loss_grad if s.checkpointing and model.has_shape() else 0.0),
        "workspace": WORKSPACE_BASE + max(opt_temp, dequant),
        "communication": comm,
    }
    states = cats["weights"] + cats["gradients"] + cats["optimizer"]
    F["model states"] = (f"weights + gradients + optimizer = {states / max(P, 1):.2f} B/param "
                         f"of {fmt_count(P)}")
    out: dict[str, Any] = {c: int(round(v)) for c, v in cats.items()}
    out.update({
        "total_bytes": int(round(total)),
        "peak_phase": peak_phase,
        "phases": {k: int(round(v)) for k, v in phases.items()},
        "model_states_bytes": int(round(states)),
        "sum_of_categories_bytes": int(round(sum(cats.values()))),
        "params": P,
        "trainable_params": int(Pt),
        "card_bytes": s.card_bytes,
        "fits": total <= s.card_bytes,
        "formulas": F,
        "notes": notes,
        "model": dataclasses.asdict(model) | {"params": P, "intermediate": (
            model.ffn() if model.hidden else None)},
        "inputs": dataclasses.asdict(s),
    })
    return out
