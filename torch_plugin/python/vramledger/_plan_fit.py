"""`vramledger plan --fit batch|seq`: the largest micro-batch or sequence length whose planned
peak, times the allocator's measured fragmentation allowance, fits the card.

Pure Python, no torch. The planner's peak (_plan.estimate) never falls as the micro-batch or the
sequence grows, so the largest size that fits is found by bisection over [1, MAX_SIZE].
docs/design/memory-planner.md, "The largest run that fits".
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from vramledger import _plan, _plan_cli
from vramledger._plan import PlanError, gb

# Peak reserved / peak allocated of real training on the H200, the largest of the three workloads
# (GPT-2-medium, Llama-1B, Llama-1B with checkpointing) for each allocator, measured with no cap on
# memory: docs/results/h200-training.md, "Three allocators on three workloads".
ALLOWANCES = {"vramledger": 1.0088, "torch-expandable": 1.0437, "torch": 1.4591}
ALLOWANCE_SOURCE = "docs/results/h200-training.md, \"Three allocators on three workloads\""
ALLOCATOR_NAMES = {"vramledger": "vramledger (install() defaults)",
                   "torch-expandable": "torch expandable_segments:True",
                   "torch": "torch native"}
DIMENSIONS = {"batch": "micro-batch", "seq": "sequence length"}
MAX_SIZE = {"batch": 1 << 16, "seq": 1 << 22}  # the search's bound


def add_arguments(p) -> None:
    """The flags `--fit` adds to `vramledger plan`."""
    p.add_argument("--fit", choices=tuple(DIMENSIONS),
                   help="print the plan at the largest micro-batch (batch; give --seq) or "
                        "sequence length (seq; give --batch) whose planned peak x the allocator's "
                        "allowance fits --card-gib; exit status 1 when not even size 1 fits")
    p.add_argument("--allocator", choices=tuple(ALLOWANCES), default=None,
                   help="with --fit: the allocator whose fragmentation allowance (peak reserved / "
                        "peak allocated) that multiplies the planned peak: "
                        + ", ".join(f"{k} {v}" for k, v in ALLOWANCES.items())
                        + " (default vramledger), the largest measured on the H200 over GPT-2-"
                          "medium, Llama-1B and Llama-1B with checkpointing with no cap on memory "
                          f"({ALLOWANCE_SOURCE}); under a cap torch native frees its cache and "
                          "retries before it fails, so its allowance there may be smaller")


@dataclasses.dataclass
class Fit:
    """The largest size that fits, and the figures beside it. `size` 0: not even 1 fits;
    `size` == `bound`: every size tried fits."""
    dimension: str
    size: int
    bound: int
    allocator: str
    allowance: float
    card_bytes: int
    estimate: dict[str, Any] | None       # the plan at `size` (at 1 when nothing fits)
    above: dict[str, Any] | None          # the plan at size + 1 (None at the bound)

    def needed(self, est: dict[str, Any]) -> int:
        """Bytes of reserved memory the allocator needs for the plan `est`."""
        return needed_bytes(est["total_bytes"], self.allowance)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dimension": self.dimension, "size": self.size, "bound": self.bound,
            "allocator": self.allocator, "allowance": self.allowance,
            "allowance_source": ALLOWANCE_SOURCE, "card_bytes": self.card_bytes,
            "planned_peak_bytes": self.estimate["total_bytes"],
            "needed_bytes": self.needed(self.estimate),
        }
        if self.above is not None:
            out.update(next_size=self.size + 1, next_planned_peak_bytes=self.above["total_bytes"],
                       next_needed_bytes=self.needed(self.above))
        return out


def needed_bytes(planned: int, allowance: float) -> int:
    """`planned` peak allocated bytes x the allowance, rounded up to a byte."""
    return -(-planned * round(allowance * 10**6) // 10**6)


def fit(model: _plan.Model, setup: _plan.Setup, dimension: str, allocator: str) -> Fit:
    """The largest `dimension` ("batch" or "seq") in [1, MAX_SIZE[dimension]], the other held at
    `setup`'s value, for which needed_bytes(estimate) <= setup.card_bytes."""
    allowance = ALLOWANCES[allocator]
    bound = MAX_SIZE[dimension]

    def plan_at(n: int) -> dict[str, Any]:
        return _plan.estimate(model, dataclasses.replace(setup, **{dimension: n}))

    def fits(n: int) -> bool:
        return needed_bytes(plan_at(n)["total_bytes"], allowance) <= setup.card_bytes

    result = Fit(dimension, 0, bound, allocator, allowance, setup.card_bytes, None, None)
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


def check_fit_flags(args) -> None:
    """PlanError for --allocator without --fit, or --fit without the sizes it needs."""
    if args.fit is None:
        if args.allocator is not None:
            raise PlanError("--allocator applies to --fit only (give --fit batch or --fit seq)")
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
    try:
        check_fit_flags(args)
        if args.fit is None:
            return _plan_cli.run(args, cli_error)
        model, setup = _plan_cli.model_and_setup(args)
        if not model.has_shape():
            raise PlanError(f"--fit needs the model's shape, which sets how the activations grow "
                            f"with the {DIMENSIONS[args.fit]}: give --config, or --layers, "
                            f"--hidden and --vocab")
        result = fit(model, setup, args.fit, allocator)
    except PlanError as e:
        raise cli_error(str(e)) from e
    dim, word = args.fit, DIMENSIONS[args.fit]
    where = (f"seq {setup.seq}" if dim == "batch" else f"micro-batch {setup.batch}")
    alloc = f"{ALLOCATOR_NAMES[allocator]}'s allowance {result.allowance:g}"
    if result.size == 0:
        est = result.estimate
        # The optimizer step holds the weights, gradients, optimizer state and its temporaries,
        # whatever the size: the floor no size goes below.
        floor = needed_bytes(est["phases"]["optimizer_step"], result.allowance)
        why = (f"the optimizer step alone (weights, gradients, optimizer state, at any size) "
               f"needs {gb(floor)}" if floor > result.card_bytes
               else f"a smaller --{'seq' if dim == 'batch' else 'batch'} may fit")
        print(f"vramledger: error: nothing fits the card {gb(result.card_bytes)}: {dim} 1 at "
              f"{where} plans {gb(est['total_bytes'])} x {alloc} = "
              f"{gb(result.needed(est))}; {why}", file=sys.stderr)
        return 1
    if result.above is None:
        raise cli_error(f"every {word} tried fits the card {gb(result.card_bytes)}, up to "
                        f"{dim} {result.bound} (the search's bound) at {where}: it plans "
                        f"{gb(result.estimate['total_bytes'])} x {alloc} = "
                        f"{gb(result.needed(result.estimate))}")
    header = (f"vramledger plan --fit {dim}: the largest {word} that fits is {result.size} at "
              f"{where} ({alloc}, {ALLOWANCE_SOURCE}):\n"
              f"  {dim} {result.size}: planned peak {gb(result.estimate['total_bytes'])} x "
              f"{result.allowance:g} = {gb(result.needed(result.estimate))} <= card "
              f"{gb(result.card_bytes)}\n"
              f"  {dim} {result.size + 1}: planned peak {gb(result.above['total_bytes'])} x "
              f"{result.allowance:g} = {gb(result.needed(result.above))} > card\n\n")
    return _plan_cli.emit(args, result.estimate, cli_error, header=header,
                          extra={"fit": result.as_json()})
