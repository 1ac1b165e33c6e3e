"""How often the step rounds' 90% interval (step_rounds.interval) holds the true ratio, by the
number of rounds: a check of the statistics on simulated rounds, not a measurement of a GPU.

Each trial draws N rounds' ratios around a true ratio of 1 (log-normal, the logs' standard
deviation SPREAD; on one machine the shares do not depend on it, as both intervals scale with the
rounds' spread) and asks whether each interval reaches it: the bootstrap's alone
(step_rounds.bootstrap_interval), Student's t alone (step_rounds.t_interval) and the one the tables
give, the smallest spanning both. With --machines K, K machines of N rounds each, each machine's
rounds shifted alike by its own draw (log-normal, MACHINE_SPREAD), the intervals resampling and
counting machines as the tables' do for rounds of several machines. With --machine-rounds, one
line for machines of unequal rounds, as real rows have (2 to 29 a machine; a round whose record
names no machine counts as a machine of its own, of 1 round): `--machine-rounds 29 10 10 7 3 3 2 1
1 1 1 1 1` is Llama-1B's 24 GiB sequence row. Real rounds are less tidy still (far-off rounds,
machines that differ by more than a log-normal shift): with --tails t3 the rounds' and the
machines' log draws come from Student's t with 3 degrees of freedom, scaled to the same standard
deviation (a draw beyond 4 standard deviations about once in 160, a normal one once in 16,000), so
that a draw that far off turns up in some comparisons of a few rounds and most of many; the shares
are those of these cases, not of the real machines.
A 90% interval that holds the true ratio in far fewer than 90% of the trials passes a verdict it
should not: "not above" needs the upper end at most 1.02, and an interval too narrow gets there
too early.

  python -m benchmarks.capacity.coverage [--rounds 3 6 12 24] [--trials 1000] [--spread 0.02]
      [--machines 1 | --machine-rounds N ...] [--machine-spread 0.02] [--tails normal|t3]
      [--seed 0] [--resamples 2000]

prints a line per N (the tables resample 10,000 times; 2,000 moves a percentile by little and keeps
a line of one machine to seconds on a 2-core machine; 19 machines of 6 rounds take about two
minutes). Deterministic for a seed. Exit status 0; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import math
import random

from benchmarks.capacity import exit_with, step_rounds

KINDS = ("bootstrap", "t", "interval")
TAILS = ("normal", "t3")


def draw(rng: random.Random, sd: float, tails: str) -> float:
    """A draw of mean 0 and standard deviation `sd`: normal, or Student's t with 3 degrees of
    freedom (variance 3, so scaled by 1 / sqrt(3)) for "t3"."""
    z = rng.gauss(0.0, 1.0)
    if tails == "t3":
        chi2 = sum(rng.gauss(0.0, 1.0) ** 2 for _ in range(3))
        z = z / math.sqrt(chi2 / 3) / math.sqrt(3)
    return sd * z


def coverage(rounds: int | list[int], *, trials: int = 1000, spread: float = 0.02,
             machines: int = 1, machine_spread: float = 0.02, seed: int = 0,
             resamples: int = step_rounds.RESAMPLES, tails: str = "normal") -> dict[str, float]:
    """The share of `trials` simulated comparisons in which each kind of interval (KINDS) holds
    the true ratio, 1: `rounds` rounds, on each of `machines` machines where there are several;
    or, where `rounds` is a sequence, one machine of each of its numbers of rounds (`machines`
    unused). The log draws are normal, or Student's t of 3 degrees of freedom (`tails`, draw())."""
    sizes = [rounds] * machines if isinstance(rounds, int) else list(rounds)
    rng = random.Random(seed)
    held = dict.fromkeys(KINDS, 0)
    for trial in range(trials):
        ratios, on = [], []
        for m, size in enumerate(sizes):
            shift = draw(rng, machine_spread, tails) if len(sizes) > 1 else 0.0
            ratios += [math.exp(shift + draw(rng, spread, tails)) for _ in range(size)]
            on += [f"machine {m}"] * size
        bounds = {"bootstrap": step_rounds.bootstrap_interval(ratios, machines=on,
                                                              resamples=resamples, seed=trial),
                  "t": step_rounds.t_interval(ratios, machines=on)}
        bounds["interval"] = step_rounds.span(bounds["bootstrap"], bounds["t"])  # interval()'s
        for kind, (_, low, high) in bounds.items():
            held[kind] += low <= 1.0 <= high
    return {kind: count / trials for kind, count in held.items()}


def table(rounds: list[int], *, trials: int, spread: float, machines: int, machine_spread: float,
          seed: int, resamples: int, machine_rounds: list[int] | None = None,
          tails: str = "normal") -> str:
    """The coverage table: a line per number of rounds, or one line for `machine_rounds`."""
    if machine_rounds:
        where = (f"{len(machine_rounds)} machines (spread {machine_spread:g}) of "
                 f"{' / '.join(map(str, machine_rounds))} rounds, N in all")
        rounds = [machine_rounds]
    else:
        where = (f"{machines} machines (spread {machine_spread:g}) of N rounds each"
                 if machines > 1 else "N rounds")
    drawn = ("log-normal rounds" if tails == "normal" else
             ("rounds and machines" if machines > 1 or machine_rounds else "rounds")
             + " drawn from Student's t of 3 degrees of freedom in the log")
    lines = [f"Share of {trials} simulated comparisons ({where}, {drawn}, spread "
             f"{spread:g}, true ratio 1) whose 90% interval holds the true ratio:", "",
             "| N | bootstrap alone | Student's t alone | the tables' interval (spanning both) |",
             "|---|---|---|---|"]
    for n in rounds:
        figures = coverage(n, trials=trials, spread=spread, machines=machines,
                           machine_spread=machine_spread, seed=seed, resamples=resamples,
                           tails=tails)
        lines.append(f"| {sum(n) if isinstance(n, list) else n} | "
                     + " | ".join(f"{figures[k]:.3f}" for k in KINDS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.capacity.coverage",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, nargs="+", default=None, metavar="N",
                    help="rounds per comparison (per machine with --machines), a line each "
                         "(default 3 6 12 24)")
    ap.add_argument("--trials", type=int, default=1000, help="simulated comparisons per line")
    ap.add_argument("--spread", type=float, default=0.02,
                    help="the standard deviation of a round's log ratio (on one machine the "
                         "shares do not depend on it; on several, on its ratio to "
                         "--machine-spread)")
    ap.add_argument("--machines", type=int, default=None,
                    help="machines per comparison, each machine's rounds shifted alike "
                         "(default 1)")
    ap.add_argument("--machine-rounds", type=int, nargs="+", default=None, metavar="N",
                    help="one line: a machine of each of these numbers of rounds")
    ap.add_argument("--machine-spread", type=float, default=None,
                    help="the standard deviation of a machine's shift (default 0.02; needs "
                         "--machines 2 or more, or --machine-rounds)")
    ap.add_argument("--tails", choices=TAILS, default="normal",
                    help="the rounds' and machines' log draws: normal (default), or Student's t "
                         "of 3 degrees of freedom with the same standard deviation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resamples", type=int, default=2000,
                    help="bootstrap resamples (the tables' own: 10000; at least 100)")
    a = ap.parse_args(argv)
    if a.machine_rounds is not None:
        if a.rounds is not None or a.machines is not None:
            ap.error("--machine-rounds names every machine's rounds: leave out --rounds and "
                     "--machines")
        if len(a.machine_rounds) < 2 or min(a.machine_rounds) < 1:
            ap.error(f"--machine-rounds needs 2 or more machines of 1 or more rounds each, got "
                     f"{a.machine_rounds}")
    if a.machines is not None and a.machines < 1:
        ap.error(f"--machines must be at least 1, got {a.machines}")
    a.machines = 1 if a.machines is None else a.machines
    machines = a.machines if a.machine_rounds is None else len(a.machine_rounds)
    if a.machine_spread is not None and machines < 2:
        ap.error("--machine-spread shifts each machine's rounds: it needs --machines 2 or more "
                 "(or --machine-rounds)")
    rounds = [3, 6, 12, 24] if a.rounds is None else a.rounds
    machine_spread = 0.02 if a.machine_spread is None else a.machine_spread
    if any(n < 1 or n * a.machines < 2 for n in rounds):
        ap.error(f"--rounds: an interval needs 2 or more rounds in all, got {rounds} on "
                 f"{a.machines} machine(s)")
    if machine_spread < 0:
        ap.error(f"--machine-spread must be 0 or more, got {machine_spread}")
    if a.trials < 1:
        ap.error(f"--trials must be at least 1, got {a.trials}")
    if a.resamples < 100:
        ap.error(f"--resamples must be at least 100 for a 5th and a 95th percentile, got "
                 f"{a.resamples}")
    if not a.spread > 0:
        ap.error(f"--spread must be above 0, got {a.spread}")
    print(table(rounds, trials=a.trials, spread=a.spread, machines=a.machines,
                machine_spread=machine_spread, seed=a.seed, resamples=a.resamples,
                machine_rounds=a.machine_rounds, tails=a.tails))
    return 0


if __name__ == "__main__":
    exit_with(main)
