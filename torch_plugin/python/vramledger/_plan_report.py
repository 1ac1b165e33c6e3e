"""The planner's outputs from an estimate: the plan file the guard enforces
(docs/design/plan-file.md) and the category table `vramledger plan` prints.
Pure Python, no torch; no state."""

from __future__ import annotations

import math
from typing import Any

from vramledger._plan_model import CATEGORIES, MIB, PlanError, fmt_count, gb


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
        f"vramledger plan: {m['name']} ({shape}), {fmt_count(est['params'])} params, "
        f"{fmt_count(est['trainable_params'])} trainable",
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
