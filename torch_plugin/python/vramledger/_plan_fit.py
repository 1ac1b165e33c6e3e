"""`vramledger plan --fit batch|seq`: the largest micro-batch or sequence length whose planned
peak, with the allocator's allowance, fits the card.

Pure Python, no torch. The planner's peak (_plan.estimate) never falls as the micro-batch or the
sequence grows, so the largest size that fits is found by bisection over [1, MAX_SIZE]. The
allowances (under a cap, the default, and uncapped) are _plan_allowance.py's.
docs/design/memory-planner.md, "The largest run that fits".
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from vramledger import _plan, _plan_allowance, _plan_cli
from vramledger._plan import PlanError, gb
from vramledger._plan_allowance import ALLOCATOR_NAMES, Allowance, TrainingKind

DIMENSIONS = {"batch": "micro-batch", "seq": "sequence length"}
MAX_SIZE = {"batch": 1 << 16, "seq": 1 << 22}  # the search's bound


def add_arguments(p) -> None:
    """The flags `--fit` adds to `vramledger plan`."""
    p.add_argument("--fit", choices=tuple(DIMENSIONS),
                   help="print the plan at the largest micro-batch (batch; give --seq) or "
                        "sequence length (seq; give --batch) whose planned peak x the allocator's "
                        "allowance fits --card-gib; exit status 1 when not even size 1 fits")
    p.add_argument("--allocator", choices=tuple(ALLOCATOR_NAMES), default=None,
                   help="with --fit: the allocator whose allowance (reserved bytes per allocated "
                        "byte) multiplies the planned peak (default vramledger)")
    p.add_argument("--allowance", choices=_plan_allowance.MODELS, default=None,
                   help="with --fit: cap (default): the allocator under a cap on reserved "
                        "memory, where torch's allocators free their cache and retry before they "
                        "fail (" + ", ".join(f"{k} {v:g}" for k, v in
                                             _plan_allowance.UNDER_A_CAP.items() if k != "torch")
                        + "; torch native by how the model trains: " + "; ".join(
                            f"{k.short} {_plan_allowance.TORCH_BY_KIND[k.workload]:.4f}"
                            for k in _plan_allowance.TORCH_KINDS)
                        + f"; any other {_plan_allowance.UNDER_A_CAP['torch']:.4f}; with the "
                          f"planned peak x {_plan_allowance.PEAK_CORRECTION:g}; "
                          f"{_plan_allowance.CALIBRATION_RECORDS}); uncapped: peak reserved / peak "
                          "allocated with abundant memory ("
                        + ", ".join(f"{k} {v:g}" for k, v in _plan_allowance.UNCAPPED.items())
                        + f"; {_plan_allowance.UNCAPPED_SOURCE})")


@dataclasses.dataclass
class Fit:
    """The largest size that fits, and the figures beside it. `size` 0: not even 1 fits (its JSON
    gives the plan at 1 as the next size's); `size` == `bound`: every size tried fits, up to the
    model's learned positions (`limit` "positions") or the search's bound ("search")."""
    dimension: str
    size: int
    bound: int
    limit: str  # what `bound` is: "positions" (the model takes no longer sequence) or "search"
    allowance: Allowance
    card_bytes: int
    estimate: dict[str, Any] | None       # the plan at `size` (at 1 when nothing fits)
    above: dict[str, Any] | None          # the plan at size + 1 (None at the bound)
    kind: TrainingKind | None = None      # how the setup trains (torch native's factor)
    why: str = ""                         # with no kind: what differs from every measured one

    @property
    def allocator(self) -> str:
        return self.allowance.allocator

    def limited_by(self) -> str:
        """What ends the size: "card" (the next size does not fit), "positions" (the model's
        learned positions), "search" (the search's bound) or "nothing fits"."""
        if self.size == 0:
            return "nothing fits"
        return "card" if self.above is not None else self.limit

    def needed(self, est: dict[str, Any]) -> int:
        """Bytes of reserved memory the allocator needs for the plan `est`."""
        return self.allowance.needed(est["total_bytes"])

    def as_json(self) -> dict[str, Any]:
        a = self.allowance
        out: dict[str, Any] = {
            "dimension": self.dimension, "size": self.size, "bound": self.bound,
            "limited_by": self.limited_by(),
            "allocator": a.allocator, "allowance_model": a.model, "allowance": a.factor,
            "peak_correction": a.peak_correction, "allowance_source": a.source,
            "allowance_measured_for": a.measured_for,
            "training_kind": ({"workload": self.kind.workload, "title": self.kind.title,
                               "trains_as": self.kind.short} if self.kind
                              else {"workload": None, "differs": self.why}),
            "allowances": {m: dataclasses.asdict(_plan_allowance.allowance(
                a.allocator, m, self.kind, self.why)) for m in _plan_allowance.MODELS},
            "card_bytes": self.card_bytes,
        }
        if self.size == 0:  # the plan at 1 is the size above, the one that does not fit
            out.update(planned_peak_bytes=None, needed_bytes=None, next_size=1,
                       next_planned_peak_bytes=self.estimate["total_bytes"],
                       next_needed_bytes=self.needed(self.estimate))
            return out
        out.update(planned_peak_bytes=self.estimate["total_bytes"],
                   needed_bytes=self.needed(self.estimate))
        if self.above is not None:
            out.update(next_size=self.size + 1, next_planned_peak_bytes=self.above["total_bytes"],
                       next_needed_bytes=self.needed(self.above))
        return out


def fit(model: _plan.Model, setup: _plan.Setup, dimension: str, allocator: str,
        allowance_model: str = "cap") -> Fit:
    """The largest `dimension` ("batch" or "seq") in [1, MAX_SIZE[dimension]], the other held at
    `setup`'s value, for which the allocator's reserved bytes for the estimate, in
    `allowance_model` ("cap" or "uncapped"), are at most setup.card_bytes; torch native's
    allowance under a cap is that of the setup's training kind (kind_of())."""
    kind, why = kind_of(model, setup)
    result = fit_with(model, setup, dimension,
                      _plan_allowance.allowance(allocator, allowance_model, kind, why))
    result.kind, result.why = kind, why
    return result


def kind_of(model: _plan.Model, setup: _plan.Setup) -> tuple[TrainingKind | None, str]:
    """The measured training kind (_plan_allowance.TORCH_KINDS) the setup trains as, or None and
    what differs from every measured one."""
    return _plan_allowance.training_kind(
        model.mlp, setup.checkpointing, setup.lora_rank, lora_targets=setup.lora_targets,
        precision=setup.precision, optimizer=setup.optimizer, qlora=setup.qlora,
        eager_attention=setup.eager_attention, zero_stage=setup.zero_stage, gpus=setup.gpus)


def fit_with(model: _plan.Model, setup: _plan.Setup, dimension: str,
             allowance: Allowance) -> Fit:
    """fit() with an allowance given whole, in place of an allocator's own in one of its models
    (benchmarks/capacity/calibrate.py tries other factors).

    Raises:
      ValueError: the allowance names an allocator that is not one of ALLOCATOR_NAMES.
    """
    _plan_allowance.check_allocator(allowance.allocator)
    bound, limit = MAX_SIZE[dimension], "search"
    # A model with learned position embeddings (GPT-2) takes no sequence longer than them.
    if dimension == "seq" and 0 < model.positions < bound:
        bound, limit = model.positions, "positions"

    def plan_at(n: int) -> dict[str, Any]:
        return _plan.estimate(model, dataclasses.replace(setup, **{dimension: n}))

    def fits(n: int) -> bool:
        return allowance.needed(plan_at(n)["total_bytes"]) <= setup.card_bytes

    result = Fit(dimension, 0, bound, limit, allowance, setup.card_bytes, None, None)
    if not fits(1):
        result.estimate = plan_at(1)
        return result
    lo, hi = 1, bound + 1  # fits(lo); hi does not fit (bound + 1 is never tried)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    result.size, result.estimate = lo, plan_at(lo)
    if lo < bound:
        result.above = plan_at(lo + 1)
    return result


def describe_allowances(allocator: str, model: str, kind: TrainingKind | None = None,
                        why: str = "") -> str:
    """Both allowances of `allocator` for a setup of training kind `kind` (None: `why`), the one
    used (`model`) first, each with its source."""
    cap = _plan_allowance.allowance(allocator, "cap", kind, why)
    uncapped = _plan_allowance.allowance(allocator, "uncapped")
    measured_for = f" ({cap.measured_for})" if cap.measured_for else ""
    texts = {"cap": f"under a cap {cap.factor:g}{measured_for}, after the planned peak's "
                    f"correction x "
                    f"{cap.peak_correction:g} (measured / planned peak allocated) ({cap.source})",
             "uncapped": f"uncapped {uncapped.factor:g}, peak reserved with abundant memory, "
                         f"the plain plan's question ({uncapped.source})"}
    other = "uncapped" if model == "cap" else "cap"
    return (f"{ALLOCATOR_NAMES[allocator]}'s allowance {texts[model]}; not used: "
            f"{texts[other]}")


def check_fit_flags(args) -> None:
    """PlanError for --allocator or --allowance without --fit, or --fit without the sizes it
    needs."""
    if args.fit is None:
        for flag in ("allocator", "allowance"):
            if getattr(args, flag) is not None:
                raise PlanError(f"--{flag} applies to --fit only (give --fit batch or --fit seq)")
        return
    other = "seq" if args.fit == "batch" else "batch"
    if getattr(args, args.fit) is not None:
        raise PlanError(f"--fit {args.fit} searches the {DIMENSIONS[args.fit]}: drop "
                        f"--{args.fit} {getattr(args, args.fit)}")
    if getattr(args, other) is None:
        raise PlanError(f"--fit {args.fit} needs the {DIMENSIONS[other]} it holds fixed: "
                        f"give --{other}")


def run(args, cli_error: type[Exception]) -> int:
    """Runs `vramledger plan` with parsed `args` (the plain plan without --fit); bad input
    becomes `cli_error` (status 2); 1 when not even size 1 fits."""
    allocator = args.allocator or "vramledger"
    model_name = args.allowance or "cap"
    try:
        check_fit_flags(args)
        if args.fit is None:
            return _plan_cli.run(args, cli_error)
        model, setup = _plan_cli.model_and_setup(args)
        if not model.has_shape():
            raise PlanError(f"--fit needs the model's shape, which sets how the activations grow "
                            f"with the {DIMENSIONS[args.fit]}: give --config, or --layers, "
                            f"--hidden and --vocab")
        result = fit(model, setup, args.fit, allocator, model_name)
        cover = (fit_with(model, setup, args.fit, _plan_allowance.covering(allocator))
                 if model_name == "cap" else None)
    except PlanError as e:
        raise cli_error(str(e)) from e
    dim, word = args.fit, DIMENSIONS[args.fit]
    where = (f"seq {setup.seq}" if dim == "batch" else f"micro-batch {setup.batch}")
    times = result.allowance.describe()
    alloc = (f"{ALLOCATOR_NAMES[allocator]}'s allowance "
             f"{'under a cap' if model_name == 'cap' else 'uncapped'}")
    if result.size == 0:
        est = result.estimate
        # The optimizer step holds the weights, gradients, optimizer state and its temporaries,
        # whatever the size: the floor no size goes below.
        floor = result.allowance.needed(est["phases"]["optimizer_step"])
        why = (f"the optimizer step alone (weights, gradients, optimizer state, at any size) "
               f"needs {gb(floor)}" if floor > result.card_bytes
               else f"a smaller --{'seq' if dim == 'batch' else 'batch'} may fit")
        card, needed = amounts(result.card_bytes, result.needed(est))
        unwritten = f"; no plan file written ({args.out})" if args.out else ""
        print(f"vramledger: error: nothing fits the card {card}: {dim} 1 at "
              f"{where} plans {gb(est['total_bytes'])}{times} ({alloc}) = "
              f"{needed}; {why}{unwritten}", file=sys.stderr)
        if args.json:
            # A script reading the JSON finds size 0 and the plan at 1, which does not fit once
            # the allowance is applied (the plain plan's "fits" leaves it out).
            print(json.dumps(dict(est) | {"fits": False, "fit": fit_json(result, cover)},
                             indent=2))
        return 1
    if result.above is None and result.limit == "search":
        raise cli_error(f"every {word} tried fits the card {gb(result.card_bytes)}, up to "
                        f"{dim} {result.bound} (the search's bound) at {where}: it plans "
                        f"{gb(result.estimate['total_bytes'])}{times} ({alloc}) = "
                        f"{gb(result.needed(result.estimate))}")
    if result.above is None:  # the model's learned positions end the search
        now, card = amounts(result.needed(result.estimate), result.card_bytes)
        headline = (f"the longest sequence the model takes, {result.size} (its learned "
                    f"positions), is predicted to fit")
        next_line = (f"  seq {result.size + 1}: longer than the model's {result.size} learned "
                     f"positions; the card is not what limits the sequence\n")
    else:
        now, above, card = amounts(result.needed(result.estimate), result.needed(result.above),
                                   result.card_bytes)
        headline = f"the largest {word} predicted to fit is {result.size}"
        next_line = (f"  {dim} {result.size + 1}: planned peak "
                     f"{gb(result.above['total_bytes'])}{times} = {above} > card\n")
    # Torch native's line names the training kind; the others' factor is one for every kind, so
    # a setup unlike every measured one is said here.
    unmeasured = (f"  not measured: this setup trains as none of the capacity benchmark's "
                  f"workloads ({result.why}); the allowance is the one measured on them\n"
                  if result.kind is None and result.allowance.measured_for is None else "")
    header = (f"vramledger plan --fit {dim}: {headline} at {where} ({alloc}):\n"
              f"  {dim} {result.size}: planned peak {gb(result.estimate['total_bytes'])}{times} = "
              f"{now} <= card {card}\n"
              + next_line +
              f"  {describe_allowances(allocator, model_name, result.kind, result.why)}\n"
              + unmeasured
              + (conservative_line(cover, result.size) if cover is not None else "")
              + f"\nThe plan at {dim} {result.size} (its peak and the card's spare are before the "
                f"allocator's allowance):\n")
    return _plan_cli.emit(args, result.estimate, cli_error, header=header,
                          extra={"fit": fit_json(result, cover)})


def fit_json(result: Fit, cover: Fit | None) -> dict[str, Any]:
    """The "fit" object of --json: the result's figures and, under a cap, the conservative
    answer's."""
    out = result.as_json()
    if cover is not None:
        out["conservative"] = {"allowance": cover.allowance.factor, "size": cover.size,
                               "source": cover.allowance.source}
    return out


def amounts(*sizes: int) -> list[str]:
    """gb() of each of `sizes`, with the bytes as well wherever two sizes that differ would
    print alike (a size that fits and one that does not, a hundredth of a GB apart)."""
    texts = [gb(n) for n in sizes]
    if len(set(texts)) == len(set(sizes)):
        return texts
    return [f"{t[:-1]}, {n:,} bytes)" for t, n in zip(texts, sizes)]


def conservative_line(cover: Fit, size: int) -> str:
    """The conservative answer beside --fit's: the size at the allowance under which no limit the
    capacity benchmark measured was predicted too large (_plan_allowance.COVERING)."""
    a = cover.allowance
    dim = cover.dimension
    answer = (f"{dim} {cover.size}" + (" as well" if cover.size == size else "")
              if cover.size else f"not even {dim} 1")
    return (f"  conservative answer: {answer}, at an allowance of {a.factor:g}, under which no "
            f"limit the capacity benchmark measured for {ALLOCATOR_NAMES[a.allocator]}, on any "
            f"workload, was predicted too large (plan with this one where running out of memory "
            f"costs more than the difference; {a.source})\n")
