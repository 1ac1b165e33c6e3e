"""The planning subcommands of `vramledger`: `plan` (memory estimate and plan file: _plan.py,
_plan_cli.py, and _plan_fit.py for --fit) and `report` (per-rank peaks from step logs,
_report.py). Registered by cli.py."""

from __future__ import annotations

from vramledger import _plan_cli, _plan_fit, _report


def register(commands, cli_error: type[Exception]) -> None:
    """Adds `plan` and `report` to the `vramledger` subcommands; errors become `cli_error`."""
    plan = commands.add_parser(
        "plan", help="estimate GPU memory per category and write a plan file",
        description="Estimates a training job's GPU memory per GPU by category (weights, "
                    "gradients, optimizer, activations, workspace, communication) from a Hugging "
                    "Face config.json or flags, beside the card's capacity, and writes a plan "
                    "file the guard enforces. Exit status 1 when the planned peak does not "
                    "fit the card (the table, JSON and plan file are written all the same). "
                    "--fit batch|seq: the largest micro-batch or sequence that fits. "
                    "Formulas: docs/design/memory-planner.md.")
    _plan_cli.add_arguments(plan)
    _plan_fit.add_arguments(plan)
    plan.set_defaults(run=lambda args: _plan_fit.run(args, cli_error))
    report = commands.add_parser(
        "report", help="per-rank peaks of a job from its step logs",
        description="Reads the step logs of every rank (vramledger.step() with the step_log "
                    "option) and prints per-rank peak allocated and reserved bytes, their spread, "
                    "and ranks more than 5% above the median.")
    _report.add_arguments(report)
    report.set_defaults(run=lambda args: _report.run(args, cli_error))
