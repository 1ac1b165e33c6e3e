"""The command line of `vramledger plan`: its flags, their checks, the model and setup they
describe, and the table, JSON and plan file it writes. The estimate itself is _plan.py's."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from vramledger import _cli_shared
from vramledger._plan import (GIB, H200_BYTES, Model, PlanError, Setup, check_plan_fractions,
                              estimate, format_table, gb, model_from_config, parse_count,
                              plan_document)


def add_arguments(p) -> None:
    """The flags of `vramledger plan`."""
    p.add_argument("--config", metavar="CONFIG_JSON", help="a Hugging Face config.json")
    p.add_argument("--params", help="parameter count (7B, 354.8M, 1.1e9); default: from the shape")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, help="key/value heads (GQA); default: --heads")
    p.add_argument("--intermediate", type=int, help="MLP width; default 4h, or 8h/3 when gated")
    p.add_argument("--mlp", choices=("gated", "gelu-tanh", "gelu"),
                   help="MLP kind (default from the config; gated with flags only)")
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch per GPU (default 1)")
    p.add_argument("--precision", default="bf16-mixed",
                   choices=("fp32", "bf16-mixed", "fp16-mixed"), help="default bf16-mixed")
    p.add_argument("--optimizer", default="adamw",
                   choices=("adamw", "adamw-8bit", "sgd", "adafactor"), help="default adamw")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--lora-targets", default="attn", choices=("attn", "all"))
    p.add_argument("--qlora", action="store_true", help="4-bit NF4 base weights (LoRA rank 16 "
                                                         "unless --lora-rank)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--card-gib", type=float, default=None,
                   help="GPU memory in GiB (default: an H200, 139.80)")
    p.add_argument("--activation-model", default="calibrated", choices=("calibrated", "korthikanti"))
    p.add_argument("--eager-attention", action="store_true",
                   help="attention scores are materialised (no SDPA / flash attention)")
    p.add_argument("--headroom", type=float, default=0.10,
                   help="fraction of the plan's limit kept free (default 0.10)")
    p.add_argument("--fragmentation", type=float, default=1.10,
                   help="reserved / allocated allowance (default 1.10)")
    p.add_argument("--warn-at", type=float, default=0.9, help="warn_at of the plan (default 0.9)")
    p.add_argument("--category-limits", action="store_true",
                   help="also write per-category limits (each estimate x 1.25)")
    p.add_argument("--out", metavar="PLAN_JSON", help="write the plan file here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


# Integer flags of `vramledger plan` and their least value; an explicit 0 is a value too.
_INT_FLAGS = (("layers", 1), ("hidden", 1), ("heads", 1), ("kv_heads", 1), ("intermediate", 1),
              ("vocab", 1), ("seq", 1), ("batch", 1), ("gpus", 1), ("lora_rank", 0))
MAX_CARD_GIB = 1e6  # as replay --capacity-gib


def check_flags(args) -> None:
    """Refuses out-of-range numeric flags before any estimate, with or without --out, and an
    --out that cannot be written (empty, a directory, in a missing directory)."""
    if args.out is not None:
        _cli_shared.check_output("--out", args.out, PlanError)  # as replay, inspect, convert
    for flag, minimum in _INT_FLAGS:
        value = getattr(args, flag)
        if value is not None and value < minimum:
            raise PlanError(f"--{flag.replace('_', '-')} must be at least {minimum}, got {value}")
    if args.card_gib is not None and not (0 < args.card_gib <= MAX_CARD_GIB  # NaN fails too
                                          and int(args.card_gib * GIB) > 0):
        raise PlanError(f"--card-gib must be a positive number of GiB, at most "
                        f"{MAX_CARD_GIB:.0f}, got {args.card_gib}")
    check_plan_fractions(args.headroom, args.fragmentation, args.warn_at)


def model_and_setup(args) -> tuple[Model, Setup]:
    """The model and training setup the parsed flags describe (PlanError on a bad one)."""
    check_flags(args)
    model = model_from_config(args.config) if args.config else Model(name="model")
    for flag, attr in (("layers", "layers"), ("hidden", "hidden"), ("heads", "heads"),
                       ("kv_heads", "kv_heads"), ("intermediate", "intermediate"),
                       ("vocab", "vocab"), ("mlp", "mlp")):
        if getattr(args, flag) is not None:
            setattr(model, attr, getattr(args, flag))
    if args.heads is not None and args.kv_heads is None and not args.config:
        model.kv_heads = args.heads
    if args.params is not None:
        model.params = parse_count(args.params)
    if args.config is None and model.params is None and not model.has_shape():
        missing = [f"--{k}" for k in ("layers", "hidden", "vocab") if getattr(args, k) is None]
        raise PlanError("give --config, or --params, or the shape (--layers, --hidden, "
                        f"--vocab; missing: {', '.join(missing)})")
    if model.kv_heads and not model.heads:
        raise PlanError(f"{model.kv_heads} key/value heads (--kv-heads) without the attention "
                        "heads they share (--heads, or num_attention_heads in --config)")
    if model.kv_heads and model.heads % model.kv_heads:
        raise PlanError(f"the key/value heads (--kv-heads, or num_key_value_heads in "
                        f"--config) must divide the {model.heads} attention heads, got "
                        f"{model.kv_heads}")
    if args.seq is not None and 0 < model.positions < args.seq:
        raise PlanError(f"--seq {args.seq} is longer than the model's {model.positions} learned "
                        f"positions (from {args.config}): its position embedding takes no longer "
                        f"sequence")
    card = H200_BYTES if args.card_gib is None else int(args.card_gib * GIB)
    # Without --seq: 1024, or fewer where the model's learned positions end sooner.
    seq = args.seq if args.seq is not None else min(1024, model.positions or 1024)
    setup = Setup(seq=seq,
                  batch=1 if args.batch is None else args.batch, precision=args.precision,
                  optimizer=args.optimizer, checkpointing=args.checkpointing,
                  lora_rank=args.lora_rank, lora_targets=args.lora_targets, qlora=args.qlora,
                  zero_stage=args.zero_stage, gpus=args.gpus, card_bytes=card,
                  activation_model=args.activation_model, eager_attention=args.eager_attention)
    return model, setup


def run(args, cli_error: type[Exception]) -> int:
    """Runs `vramledger plan` with parsed `args`; errors become `cli_error`."""
    try:
        est = estimate(*model_and_setup(args))
    except PlanError as e:
        raise cli_error(str(e)) from e
    return emit(args, est, cli_error)


def emit(args, est: dict[str, Any], cli_error: type[Exception], header: str = "",
         extra: dict[str, Any] | None = None) -> int:
    """Writes the plan file (--out) and prints the estimate as a table (after `header`) or, with
    --json, as one object (with `extra`'s keys); 1 when the peak does not fit the card."""
    doc = None
    if args.out:
        try:
            doc = plan_document(est, args.headroom, args.fragmentation, args.warn_at,
                                args.category_limits, args.config or "flags")
        except PlanError as e:
            raise cli_error(str(e)) from e
    if doc is not None:
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2)
                f.write("\n")
        except OSError as e:
            raise cli_error(f"{args.out}: cannot write the plan file: {e}") from e
    if args.json:
        out = dict(est) | (extra or {})
        if doc is not None:
            out["plan_file"] = os.path.abspath(args.out)
            out["plan"] = {k: doc[k] for k in ("limit", "headroom", "warn_at")}
        print(json.dumps(out, indent=2))
    else:
        text = header + format_table(est)
        if doc is not None:
            text += (f"  plan file {args.out}: limit {gb(doc['limit'])}, headroom "
                     f"{gb(doc['headroom'])}, warn_at {doc['warn_at']:g}\n")
        print(text, end="")
    if not est["fits"]:  # a script's `vramledger plan ... && train` stops here
        print(f"vramledger: warning: the planned peak does not fit the card "
              f"({gb(est['total_bytes'] - est['card_bytes'])} over); exit status 1"
              + (f" (the plan file {args.out} is capped at the card)" if doc is not None else ""),
              file=sys.stderr)
        return 1
    return 0
