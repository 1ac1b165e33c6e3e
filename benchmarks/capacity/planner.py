"""The planner's prediction of a capacity row: `vramledger plan --fit` for the workload, the
allocator and the cap, computed in this process (the planner is pure Python)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile

from benchmarks.capacity.workloads import WORKLOADS

GIB = 1 << 30
COMMAND = ("vramledger plan --config CONFIG --seq S --fit batch (or --batch B --fit seq) "
           "--card-gib CAP --allocator A [--checkpointing] [--lora-rank 16], CONFIG and flags "
           "the workload's (benchmarks/capacity/workloads.py)")


@functools.lru_cache(maxsize=None)
def predict(workload: str, allocator: str, cap_gib: float, dim: str) -> int:
    """The largest size along `dim` the planner says fits `cap_gib` under `allocator`; 0 when not
    even 1 fits; the search's bound when every size it tried fits."""
    from vramledger import _plan, _plan_fit
    w = WORKLOADS[workload]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(w.config, f)
        model = _plan.model_from_config(path)
    batch, seq = w.shape(dim, 1)
    setup = dataclasses.replace(_plan.Setup(batch=batch, seq=seq, card_bytes=int(cap_gib * GIB)),
                                **w.plan_flags())
    return _plan_fit.fit(model, setup, dim, allocator).size
