"""`vramledger plan`: a training job's GPU memory per category, per GPU, and a plan file for it.

Pure Python, no torch. The formulas, their sources and their calibration against measured H200
runs are in docs/design/memory-planner.md; the constants below are named there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any


GB = 1e9
GIB = 1 << 30
MIB = 1 << 20
H200_BYTES = 150109880320  # torch's total_memory of an H200

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "workspace", "communication")

# Activation bytes per token per transformer layer under bf16/fp16 autocast with fp32 weights and
# fused (SDPA) attention: H_COEF * hidden + MLP_COEF[mlp] * intermediate. Calibrated on the
# measured H200 runs (GPT-2-medium and Llama-1B, the runs behind traces/); see
# docs/design/memory-planner.md.
H_COEF = 31.5
MLP_COEF = {"gelu-tanh": 16.0, "gated": 8.0, "gelu": 4.0}
FP32_ACTIVATION_FACTOR = 1.75  # fp32 training: not measured (docs/design/memory-planner.md)
LOGITS_BYTES_PER_VOCAB = {"mixed": 10, "fp32": 8}  # half logits + fp32 upcast + log-softmax
CKPT_INPUT_BYTES_PER_HIDDEN = 4  # a checkpointed layer keeps its fp32 residual input
KORTHIKANTI_PER_HIDDEN = 34  # Korthikanti et al. 2022, eq. 1, no recomputation
WORKSPACE_BASE = 64 * MIB  # cuBLAS workspaces and small buffers (measured ~63-69 MB)
QLORA_BYTES_PER_PARAM = 4.127 / 8  # NF4 with double quantisation (Dettmers et al. 2023)
OPTIMIZER_BYTES = {"adamw": 8.0, "adamw-8bit": 2.0, "sgd": 4.0}  # per trainable param
OPTIMIZER_TEMP_BYTES = {"adamw": 4.0, "adamw-8bit": 0.0, "sgd": 0.0, "adafactor": 0.0}
GATED_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
               "phi3", "olmo", "olmo2", "cohere", "internlm2", "deepseek_v2", "granite", "yi"}
TANH_GELU = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_tanh"}


class PlanError(ValueError):
    """A bad input to the planner (the message says which)."""


@dataclasses.dataclass
class Model:
    """The shape of a decoder-only transformer. Sizes are counts, not bytes."""
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    intermediate: int | None = None
    vocab: int | None = None
    mlp: str = "gated"          # "gated" (SwiGLU), "gelu-tanh" (GPT-2's gelu_new), "gelu"
    tied: bool = False          # input embedding shared with the output layer
    positions: int = 0          # learned position embeddings (GPT-2); 0 with RoPE
    biases: bool = False        # GPT-2 style biases and LayerNorm (weight + bias)
    params: int | None = None   # total parameters; counted from the shape when None
    name: str = "model"

    def ffn(self) -> int:
        if self.intermediate:
            return self.intermediate
        if self.mlp == "gated":
            return 256 * math.ceil(8 * self.hidden / 3 / 256)
        return 4 * self.hidden

    def kv_dim(self) -> int:
        heads = self.heads or 1
        return self.hidden * (self.kv_heads or heads) // heads

    def has_shape(self) -> bool:
        return bool(self.layers and self.hidden and self.vocab)

    def matrices(self) -> list[tuple[int, int]]:
        """(rows, cols) of every weight matrix of one layer."""
        h, f, kv = self.hidden, self.ffn(), self.kv_dim()
        attn = [(h, h), (h, kv), (h, kv), (h, h)]
        mlp = [(h, f), (h, f), (f, h)] if self.mlp == "gated" else [(h, f), (f, h)]
        return attn + mlp

    def count_params(self) -> int:
        if self.params:
            return self.params
        if not self.has_shape():
            raise PlanError("give --params, or the shape (--layers, --hidden, --vocab) or --config")
        h, f, kv, v = self.hidden, self.ffn(), self.kv_dim(), self.vocab
        per_layer = sum(r * c for r, c in self.matrices())
        if self.biases:  # q, k, v, o and MLP biases; two LayerNorms (weight + bias)
            per_layer += h + 2 * kv + h + (2 * f if self.mlp == "gated" else f) + h + 4 * h
            final_norm = 2 * h
        else:  # two RMSNorm weights
            per_layer += 2 * h
            final_norm = h
        embed = v * h + self.positions * h
        head = 0 if self.tied else v * h
        return self.layers * per_layer + embed + final_norm + head


def parse_count(text: str | int | float) -> int:
    """"7B", "354.8M", "1.1e9", 7000000000 -> an integer count of at least 1. PlanError
    otherwise (also for 0, NaN and counts too large for a float, such as 1e400)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", str(text), re.I)
        if not m:
            raise PlanError(f"--params: expected a count such as 7B, 354.8M or 1.1e9, "
                            f"got {text!r}")
        value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[
            m.group(2).lower()]
    if not (math.isfinite(value) and round(value) >= 1):
        raise PlanError(f"--params must be a finite count of at least 1, got {text!r}")
    return int(round(value))


def model_from_config(path: str) -> Model:
    """Reads a Hugging Face config.json (GPT-2, GPT-NeoX and Llama-style models).

    Raises:
      PlanError: unreadable file or a config without the fields needed.
    """
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: cannot read the model config: {e}") from e
    if not isinstance(c, dict):
        raise PlanError(f"{path}: a config.json is a JSON object")
    kind = str(c.get("model_type", ""))

    def first(*keys: str, default: Any = None, minimum: int = 1) -> Any:
        """The first of `keys` the config sets: an integer of at least `minimum`."""
        for k in keys:
            if c.get(k) is not None:
                if type(c[k]) is not int or c[k] < minimum:  # bool is no count
                    raise PlanError(f"{path}: {k!r} must be an integer of at least {minimum}, "
                                    f"got {c[k]!r:.60}")
                return c[k]
        return default

    def flag(key: str, default: bool) -> bool:
        """A JSON boolean of the config: the string "false" is not False (bool() made it True)."""
        value = c.get(key, default)
        if value is None:
            return default
        if type(value) is not bool:
            raise PlanError(f"{path}: {key!r} must be true or false, got {value!r:.60}")
        return value

    m = Model(name=kind or os.path.basename(path))
    m.layers = first("num_hidden_layers", "n_layer", "num_layers")
    m.hidden = first("hidden_size", "n_embd", "d_model")
    m.heads = first("num_attention_heads", "n_head")
    m.kv_heads = first("num_key_value_heads", default=m.heads)
    m.vocab = first("vocab_size")
    m.intermediate = first("intermediate_size", "n_inner", "ffn_dim")
    act = str(c.get("hidden_act") or c.get("activation_function") or "")
    if kind in ("gpt2",):
        m.mlp = "gelu-tanh" if act in TANH_GELU or not act else "gelu"
        m.tied = flag("tie_word_embeddings", True)
        m.positions = first("n_positions", "max_position_embeddings", default=0, minimum=0)
        m.biases = True
    elif kind in GATED_TYPES or act in ("silu", "swish", "swiglu"):
        m.mlp = "gated"
        m.tied = flag("tie_word_embeddings", False)
        m.biases = False
    else:  # GPT-NeoX, Falcon, ...: plain GELU MLP, biases, rotary positions
        m.mlp = "gelu-tanh" if act in TANH_GELU else "gelu"
        m.tied = flag("tie_word_embeddings", False)
        m.biases = True
    if not (m.layers and m.hidden and m.vocab):
        raise PlanError(f"{path}: the config lacks the layer count, hidden size or vocabulary "
                        "(num_hidden_layers / n_layer, hidden_size / n_embd, vocab_size)")
    return m


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


def _fmt(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n:,.0f}"


def gb(n: float) -> str:
    """"126.00 GB (117.35 GiB)"."""
    return f"{n / GB:.2f} GB ({n / GIB:.2f} GiB)"


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
        F["weights"] = (f"{base_bpp:.3g} B/param {base_name} frozen base x {_fmt(P - Pt)} + "
                        f"{6 if mixed else 4} B/param LoRA adapters x {_fmt(Pt)} (rank {rank})")
    else:
        w_persist = 4.0 * P / shard_w
        w_half = (2.0 * P if mixed else 0.0) / shard_w
        F["weights"] = (f"4 B/param fp32 weights + 2 B/param {s.precision[:4]} copies (autocast) "
                        f"= 6 B x {_fmt(P)}" if mixed else f"4 B/param fp32 x {_fmt(P)}")
    if shard_w > 1:
        F["weights"] += zs
    grads = 4.0 * Pt / shard_grad
    F["gradients"] = f"4 B/param fp32 x {_fmt(Pt)} trainable" + (zs if shard_grad > 1 else "")
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
                          f"{_fmt(Pt)} trainable" + (zs if shard_opt > 1 else ""))

    # Activations for one micro-batch.
    T = s.batch * s.seq
    act_saved = act_recompute = logits = 0.0
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
            act_saved = L * CKPT_INPUT_BYTES_PER_HIDDEN * h * T
            act_recompute = per_layer * T
            F["activations"] = (f"checkpointing: L x {CKPT_INPUT_BYTES_PER_HIDDEN} h B/token layer "
                                f"inputs x T + one layer {layer_text} B/token recomputed in "
                                f"backward + {LOGITS_BYTES_PER_VOCAB['mixed' if mixed else 'fp32']} V "
                                f"B/token logits and loss; T = {T:,}")
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
    phases = {
        "forward_end": base + w_half + act_saved + logits + dequant,
        "backward_end": base + grads + act_recompute + dequant,
        "optimizer_step": base + grads + opt_temp,
    }
    peak_phase = max(phases, key=phases.get)
    total = phases[peak_phase]
    cats = {
        "weights": w_persist + w_half,
        "gradients": grads,
        "optimizer": opt,
        "activations": max(act_saved + logits, act_recompute),
        "workspace": WORKSPACE_BASE + max(opt_temp, dequant),
        "communication": comm,
    }
    states = cats["weights"] + cats["gradients"] + cats["optimizer"]
    F["model states"] = (f"weights + gradients + optimizer = {states / max(P, 1):.2f} B/param "
                         f"of {_fmt(P)}")
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


def check_plan_fractions(headroom: float, fragmentation: float, warn_at: float) -> None:
    """PlanError unless 0 <= headroom < 1, 1 <= fragmentation (finite) and 0 < warn_at <= 1;
    NaN fails every comparison, so it is refused too."""
    if not 0 <= headroom < 1:
        raise PlanError(f"--headroom must be in [0, 1), got {headroom}")
    if not (math.isfinite(fragmentation) and fragmentation >= 1):
        raise PlanError(f"--fragmentation must be a finite number of at least 1, "
                        f"got {fragmentation}")
    if not 0 < warn_at <= 1:
        raise PlanError(f"--warn-at must be in (0, 1], got {warn_at}")


def plan_document(est: dict[str, Any], headroom: float, fragmentation: float, warn_at: float,
                  category_limits: bool, source: str) -> dict[str, Any]:
    """The plan file for an estimate: limit = peak x fragmentation / (1 - headroom), rounded up to
    256 MiB and capped at the card; headroom = that fraction of the limit; so the guard refuses
    at about peak x fragmentation. Category limits (optional) are each estimate x 1.25."""
    check_plan_fractions(headroom, fragmentation, warn_at)
    card = est["card_bytes"]
    step = 256 * MIB
    limit = int(math.ceil(est["total_bytes"] * fragmentation / (1 - headroom) / step) * step)
    limit = min(limit, card)
    doc: dict[str, Any] = {
        "vramledger_plan": 1,
        "comment": f"written by `vramledger plan` from {source}; limit = planned peak x "
                   f"{fragmentation:g} / (1 - {headroom:g}), rounded up to a multiple of 256 MiB"
                   f"{' and capped at the card' if limit == card else ''}; see "
                   f"docs/design/plan-file.md",
        "limit": limit,
        "headroom": int(limit * headroom),
        "warn_at": warn_at,
    }
    if category_limits:
        doc["category_limits"] = {c: min(card, int(est[c] * 1.25)) for c in CATEGORIES if est[c] > 0}
    doc["estimate"] = {k: est[k] for k in (*CATEGORIES, "total_bytes", "peak_phase", "phases",
                                           "params", "trainable_params", "card_bytes")}
    return doc


def format_table(est: dict[str, Any]) -> str:
    m, s = est["model"], est["inputs"]
    shape = (f"{m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, vocab {m['vocab']}, "
             f"{m['mlp']} MLP of width {m['intermediate']}" if m["layers"] else "shape unknown")
    lines = [
        f"vramledger plan: {m['name']} ({shape}), {_fmt(est['params'])} params, "
        f"{_fmt(est['trainable_params'])} trainable",
        f"  micro-batch {s['batch']} x seq {s['seq']} per GPU; {s['precision']}; {s['optimizer']}; "
        f"{'activation checkpointing' if s['checkpointing'] else 'no checkpointing'}; "
        f"ZeRO-{s['zero_stage']} on {s['gpus']} GPU{'s' if s['gpus'] > 1 else ''}",
        "",
        f"  {'category':<15} {'per GPU':<26} formula",
    ]
    for c in (*CATEGORIES, "model states"):
        value = est["model_states_bytes"] if c == "model states" else est[c]
        lines.append(f"  {c:<15} {gb(value):<26} {est['formulas'][c]}")
    ph = est["phases"]
    lines += ["", "  phases: " + " | ".join(f"{k.replace('_', ' ')} {gb(v)}" for k, v in ph.items())]
    card, total = est["card_bytes"], est["total_bytes"]
    verdict = (f"fits, {gb(card - total)} spare" if est["fits"]
               else f"DOES NOT FIT: {gb(total - card)} over")
    lines.append(f"  planned peak allocated {gb(total)} per GPU ({est['peak_phase'].replace('_', ' ')}); "
                 f"card {gb(card)}: {verdict}")
    for note in est["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines) + "\n"
