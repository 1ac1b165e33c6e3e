"""The allowances `vramledger plan --fit` multiplies the planned peak allocated by: reserved bytes
per allocated byte for each allocator, in two models, each with the measurements it comes from.

Pure Python, no torch; constants only. docs/design/memory-planner.md, "Two allowances".
  uncapped  peak reserved / peak allocated with abundant memory: what the allocator holds when
            nothing stops it growing (its cache); the plain plan's question, "how much does this
            run reserve on a large card".
  cap       what the allocator needs when a cap on reserved memory stops it growing: at the cap
            torch's allocators free their cached blocks and retry before they fail, so each one
            runs at its utilization at the limit, far above its uncapped one (torch native 0.96
            against 0.69). The question of --fit: "what is the largest run under this card size".
            Torch native's depends on how the model trains: one factor per training kind the
            capacity benchmark measured (TORCH_KINDS), the largest measured for any other.
"""

from __future__ import annotations

import dataclasses
import math

ALLOCATOR_NAMES = {"vramledger": "vramledger (install() defaults)",
                   "torch-expandable": "torch expandable_segments:True",
                   "torch": "torch native"}

# Peak reserved / peak allocated of real training on the H200 with no cap on memory, the largest
# of the three workloads (GPT-2-medium, Llama-1B, Llama-1B with checkpointing) per allocator.
UNCAPPED = {"vramledger": 1.0088, "torch-expandable": 1.0437, "torch": 1.4591}
UNCAPPED_SOURCE = "docs/results/h200-training.md, \"Three allocators on three workloads\""

# The records the cap model is calibrated on, and the rows of them it uses; every other row of
# the capacity benchmark (other workloads, other caps) evaluates it and never calibrates it.
# vramledger and torch expandable: GPT-2-medium's rows under the 24 GiB cap, one factor each
# (it predicts every workload's limits within 5%). Torch native: each training kind's own rows
# under that cap, one factor per kind (its peak reserved / peak allocated at the limit is
# 1.04-1.16 by workload, so one factor cannot serve them all); the 80 GiB rows evaluate them.
CALIBRATION_RECORDS = "docs/results/capacity-h200-results.json"
CALIBRATION_ROWS = (("gpt2m", 24.0, "batch"), ("gpt2m", 24.0, "seq"))
TORCH_CALIBRATION_CAP = 24.0
CAP_SOURCE = (f"{CALIBRATION_RECORDS}, GPT-2-medium under a 24 GiB cap (batch and sequence); "
              "python -m benchmarks.capacity.calibrate")


@dataclasses.dataclass(frozen=True)
class TrainingKind:
    """How a model trains, as far as torch native's need under a cap was seen to depend on it:
    the MLP, checkpointing and LoRA; each measured on one of the capacity benchmark's workloads
    (benchmarks/capacity/workloads.py), all of them as MEASURED_SETUP says."""
    workload: str       # the capacity benchmark's workload whose rows calibrate it
    title: str          # what was measured
    short: str          # how it trains, in a few words
    mlp: str            # the planner's Model.mlp
    checkpointing: bool
    lora: bool          # LoRA on the attention projections (q, k, v, o)


TORCH_KINDS = (
    TrainingKind("gpt2m", "GPT-2-medium, full fine-tuning", "tanh-GELU MLP", "gelu-tanh",
                 False, False),
    TrainingKind("llama1b", "Llama-1B, full fine-tuning", "gated MLP", "gated", False, False),
    TrainingKind("llama1b-ckpt", "Llama-1B, full fine-tuning with checkpointing",
                 "gated MLP + checkpointing", "gated", True, False),
    TrainingKind("llama1b-lora", "Llama-1B, LoRA r16 on attention with checkpointing",
                 "gated MLP + LoRA on attention + checkpointing", "gated", True, True),
)
MEASURED_SETUP = "bf16 autocast, AdamW, SDPA attention, one GPU"

# Under a cap: peak reserved / peak allocated of the largest size that trained in each
# calibration row (the allocator at its limit), the largest over the rows, rounded up to 1e-4.
# A fitting trial never reserved more than the cap, so this bounds what the allocator needed from
# above: the torch allocators' retries freed whatever cache it held beyond that. A row whose
# limit is its first size (Llama-1B's micro-batch 1 under 24 GiB) calibrates nothing: the next
# size plans more than the cap, so the cap never pressed that trial and its ratio is cache kept.
# Torch native's entry is the largest over its kinds: its allowance for a setup of no measured
# kind.
TORCH_BY_KIND = {"gpt2m": 1.0416, "llama1b": 1.0901, "llama1b-ckpt": 1.1146,
                 "llama1b-lora": 1.1540}
UNDER_A_CAP = {"vramledger": 1.0074, "torch-expandable": 1.0121,
               "torch": max(TORCH_BY_KIND.values())}
# Measured peak allocated / planned peak allocated, the largest over every trial that trained in
# the calibration rows, rounded up to 1e-4: the planner's peak is 0.7-0.8% high on GPT-2-medium.
PEAK_CORRECTION = 0.9933

MODELS = ("cap", "uncapped")

# The smallest allowance under a cap, to 1e-4 and with PEAK_CORRECTION, at which plan --fit
# predicts none of the capacity benchmark's measured limits too large, over every row of the
# records (calibration and evaluation rows alike): the size it gives is at most each limit
# measured. Not a calibration (no row is left to evaluate it) but the records' envelope, which
# --fit prints beside its answer; it tells how far the answer can be from a workload whose need
# under a cap differs from the calibration rows' (torch native's, 1.04-1.17 of the planned peak).
COVERING = {"vramledger": 1.0235, "torch-expandable": 1.0277, "torch": 1.1698}
COVERING_SOURCE = (f"{CALIBRATION_RECORDS}, every row; "
                   "python -m benchmarks.capacity.calibrate")


@dataclasses.dataclass(frozen=True)
class Allowance:
    """Reserved bytes an allocator needs for a planned peak allocated: planned x peak_correction
    x factor rounded up to a byte, and never below the planned peak itself, so that a size --fit
    returns is one the plain plan says fits, should the product fall below 1 (the planner's 0.7%
    excess on GPT-2-medium is about vramledger's waste under a cap: 0.9933 x 1.0074 = 1.0007)."""
    model: str              # "cap" or "uncapped" (or "covering": covering())
    allocator: str
    factor: float           # reserved / allocated
    peak_correction: float  # measured / planned peak allocated (1 in the uncapped model)
    source: str
    measured_for: str | None = None  # torch native under a cap: the training kind, or why none

    def needed(self, planned: int) -> int:
        """Reserved bytes for `planned` peak allocated bytes (exact integer arithmetic on the
        factors in millionths, so a test can recompute it)."""
        scale = round(self.factor * 10**6) * round(self.peak_correction * 10**6)
        return max(planned, -(-planned * scale // 10**12))

    def describe(self) -> str:
        """" x 0.9933 x 1.0121" as the --fit table prints it after the planned peak;
        " x max(1, C x A)" where the product C x A is below 1."""
        if self.peak_correction == 1:
            return f" x {self.factor:g}"
        product = f"{self.peak_correction:g} x {self.factor:g}"
        return (f" x max(1, {product})" if self.peak_correction * self.factor < 1
                else f" x {product}")


def check_allocator(allocator: str) -> None:
    """Raises ValueError naming the accepted allocators when `allocator` is not one of them."""
    if allocator not in ALLOCATOR_NAMES:
        raise ValueError(f"unknown allocator {allocator!r}; choose from "
                         f"{', '.join(ALLOCATOR_NAMES)}")


def training_kind(mlp: str, checkpointing: bool, lora_rank: int, *, lora_targets: str = "attn",
                  precision: str = "bf16-mixed", optimizer: str = "adamw", qlora: bool = False,
                  eager_attention: bool = False, zero_stage: int = 0,
                  gpus: int = 1) -> tuple[TrainingKind | None, str]:
    """(the measured kind in TORCH_KINDS the setup trains as, ""), or (None, what differs from
    every measured kind)."""
    differs = []
    if precision != "bf16-mixed":
        differs.append(f"precision {precision}")
    if optimizer != "adamw":
        differs.append(f"optimizer {optimizer}")
    if qlora:
        differs.append("a 4-bit (QLoRA) base")
    if eager_attention:
        differs.append("materialised attention scores")
    if zero_stage or gpus != 1:
        differs.append(f"ZeRO-{zero_stage} on {gpus} GPU{'' if gpus == 1 else 's'}")
    if lora_rank > 0 and lora_targets != "attn":
        differs.append(f"LoRA on {lora_targets} projections")
    if differs:
        return None, f"{', '.join(differs)}, where every one measured ran {MEASURED_SETUP}"
    key = (mlp, bool(checkpointing), lora_rank > 0)
    kind = next((k for k in TORCH_KINDS if (k.mlp, k.checkpointing, k.lora) == key), None)
    if kind is not None:
        return kind, ""
    mlp_name = {"gated": "gated", "gelu-tanh": "tanh-GELU", "gelu": "exact-GELU"}.get(mlp, mlp)
    this = (f"{mlp_name} MLP" + (" + LoRA" if lora_rank > 0 else "")
            + (" + checkpointing" if checkpointing else ""))
    return None, f"{this}, none of the measured {' / '.join(k.short for k in TORCH_KINDS)}"


def allowance(allocator: str, model: str = "cap", kind: TrainingKind | None = None,
              why: str = "") -> Allowance:
    """The allowance of `allocator` (a key of ALLOCATOR_NAMES) in `model` ("cap" or "uncapped");
    torch native's under a cap is `kind`'s (training_kind()), or with none the largest measured,
    `why` saying what differs.

    Raises:
      ValueError: an unknown allocator or model (the message names the accepted ones).
    """
    check_allocator(allocator)
    if model == "cap" and allocator == "torch":
        if kind is None:
            return Allowance("cap", allocator, UNDER_A_CAP["torch"], PEAK_CORRECTION,
                             f"{CALIBRATION_RECORDS}, every kind's rows under a "
                             f"{TORCH_CALIBRATION_CAP:g} GiB cap; "
                             "python -m benchmarks.capacity.calibrate",
                             f"the largest measured, as no measured setup trains as this one: "
                             f"{why or 'no training kind given'}")
        return Allowance("cap", allocator, TORCH_BY_KIND[kind.workload], PEAK_CORRECTION,
                         f"{CALIBRATION_RECORDS}, {kind.workload}'s rows under a "
                         f"{TORCH_CALIBRATION_CAP:g} GiB cap; "
                         "python -m benchmarks.capacity.calibrate",
                         f"measured on {kind.title}; this setup trains the same way: "
                         f"{kind.short}, {MEASURED_SETUP}")
    if model == "cap":
        return Allowance("cap", allocator, UNDER_A_CAP[allocator], PEAK_CORRECTION, CAP_SOURCE)
    if model == "uncapped":
        return Allowance("uncapped", allocator, UNCAPPED[allocator], 1.0, UNCAPPED_SOURCE)
    raise ValueError(f"unknown allowance model {model!r}; choose from {', '.join(MODELS)}")


def covering(allocator: str) -> Allowance:
    """The allowance that covers every measured limit of `allocator` (COVERING), model
    "covering"; not one of MODELS (--allowance does not take it).

    Raises:
      ValueError: an unknown allocator.
    """
    check_allocator(allocator)
    return Allowance("covering", allocator, COVERING[allocator], PEAK_CORRECTION, COVERING_SOURCE)


def round_up(x: float, digits: int = 4) -> float:
    """`x` rounded up to `digits` decimals: a calibrated constant never below its measurement."""
    scale = 10**digits
    return math.ceil(x * scale - 1e-9) / scale
