"""The planner's vocabulary: a decoder-only transformer's shape (from flags or a Hugging Face
config.json), parameter counts, units, the memory categories, and the planner's error type.

Pure Python, no torch; no state. docs/design/memory-planner.md.
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
GATED_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
               "phi3", "olmo", "olmo2", "cohere", "internlm2", "deepseek_v2", "granite", "yi"}
TANH_GELU = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_tanh"}


class PlanError(ValueError):
    """A bad input to the planner (the message says which)."""


def fmt_count(n: float) -> str:
    """"1.23B", "354.82M", "4,096": a count for the planner's tables."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n:,.0f}"


def gb(n: float) -> str:
    """"126.00 GB (117.35 GiB)"."""
    return f"{n / GB:.2f} GB ({n / GIB:.2f} GiB)"


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
