"""The planner's side of a capacity row: `vramledger plan --fit` for the workload, the allocator
and the cap under either allowance model, and the planned peak of a trial's shape, computed in
this process (the planner is pure Python)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile

from benchmarks.capacity.workloads import WORKLOADS

GIB = 1 << 30
COMMAND = ("vramledger plan --config CONFIG --seq S --fit batch (or --batch B --fit seq) "
           "--card-gib CAP --allocator A [--allowance cap|uncapped] [--checkpointing] "
           "[--lora-rank 16], CONFIG and flags the workload's (benchmarks/capacity/workloads.py)")


@functools.lru_cache(maxsize=None)
def _model(workload: str):
    from vramledger import _plan
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(WORKLOADS[workload].config, f)
        return _plan.model_from_config(path)


def _setup(workload: str, batch: int, seq: int, cap_gib: float = 80.0):
    from vramledger import _plan
    return dataclasses.replace(
        _plan.Setup(batch=batch, seq=seq, card_bytes=int(cap_gib * GIB)),
        **WORKLOADS[workload].plan_flags())


@functools.lru_cache(maxsize=None)
def planned_peak(workload: str, batch: int, seq: int) -> int:
    """The plain plan's peak allocated bytes for a trial of `workload` at (batch, longest seq)."""
    from vramledger import _plan
    return _plan.estimate(_model(workload), _setup(workload, batch, seq))["total_bytes"]


@functools.lru_cache(maxsize=None)
def predict(workload: str, allocator: str, cap_gib: float, dim: str, model: str = "cap") -> int:
    """The largest size along `dim` the planner says fits `cap_gib` under `allocator` with the
    allowance `model` ("cap" or "uncapped"); 0 when not even 1 fits; the search's bound when
    every size it tried fits."""
    from vramledger import _plan_fit
    batch, seq = WORKLOADS[workload].shape(dim, 1)
    return _plan_fit.fit(_model(workload), _setup(workload, batch, seq, cap_gib), dim, allocator,
                         model).size


def predict_with(workload: str, cap_gib: float, dim: str, allowance) -> int:
    """predict() with `allowance` (a vramledger._plan_allowance.Allowance) in place of the
    allocator's own; not cached."""
    from vramledger import _plan_fit
    batch, seq = WORKLOADS[workload].shape(dim, 1)
    return _plan_fit.fit_with(_model(workload), _setup(workload, batch, seq, cap_gib), dim,
                              allowance).size


def predict_uncapped(workload: str, allocator: str, cap_gib: float, dim: str) -> int:
    """predict() with the uncapped allowance (peak reserved with abundant memory)."""
    return predict(workload, allocator, cap_gib, dim, "uncapped")


def calibration_rows(allocator: str) -> list[tuple[str, float, str]]:
    """The rows `allocator`'s allowance under a cap is calibrated on: GPT-2-medium's under 24 GiB
    (vramledger/_plan_allowance.py's CALIBRATION_ROWS), for torch native every measured training
    kind's rows under TORCH_CALIBRATION_CAP."""
    from vramledger import _plan_allowance as pa
    if allocator != "torch":
        return list(pa.CALIBRATION_ROWS)
    return [(k.workload, pa.TORCH_CALIBRATION_CAP, dim) for k in pa.TORCH_KINDS
            for dim in ("batch", "seq")]


def role(workload: str, cap_gib: float, dim: str, allocator: str) -> str:
    """"calibration" for a row `allocator`'s allowance under a cap is calibrated on, "evaluation"
    for any other."""
    return ("calibration" if (workload, float(cap_gib), dim) in calibration_rows(allocator)
            else "evaluation")
