# The `vramledger` command line: parses the subcommand and runs it (replay, inspect, convert, diff,
# plan, report, run, each in its own module). Stateless; one call per process.
"""Command-line entry point of vramledger (``python -m vramledger``).

Subcommands:
  replay TRACE [--capacity-gib N] [--json] [--conf key:value,...] [--device N]
               [--timeline OUT.csv] [--plot OUT.png] [--sample-every N] [--gpu-lag-us N]
               [--ignore-releases] [--plan-keep-going]
      TRACE is a trace CSV (``action,addr,size,stream,time_us``, plain or .gz) or a torch memory
      snapshot pickle (``torch.cuda.memory._snapshot()``, ``.pickle`` / ``.pickle.gz``, or its JSON
      form, ``.json`` / ``.json.gz``), whose
      ``device_traces[N]`` is replayed. Sizes are bytes, times microseconds. A ``snapshot`` event
      ends a training step (utilization_at_each_step). --timeline writes allocated, reserved and
      wasted bytes over the trace with the trace's own reserved bytes as CSV; --plot draws them.
      --gpu-lag-us N: the simulated GPU finishes work N microseconds of trace time after the
      host queued it (fences complete late, as on a real GPU; default 0: at once).
      The program's releases (runs of segment_free / segment_unmap: empty_cache(), torch's
      out-of-memory retries) empty the replay's cache where they happened (--ignore-releases:
      not). --conf plan:FILE enforces the plan on the simulated device and reports the first
      refusal (--plan-keep-going: every refusal) with exit status 1.

Errors print ``vramledger: error: ...`` on stderr and exit with status 2; ``plan`` exits with 1
when the planned peak does not fit the card, ``report --fail-on-flag`` when a rank is flagged,
``replay`` when the plan refused an allocation.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from vramledger import _replay_cli  # replay
from vramledger import _snapshot_cli  # inspect, convert, diff
from vramledger import _guard_cli  # plan, report
from vramledger import _run_cli  # run (LD_PRELOAD shim)
from vramledger._cli_shared import CliError


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse calls this and expects no return
        raise CliError(f"{message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="vramledger", description=__doc__.splitlines()[0])
    from vramledger import __version__  # the package is imported by now (cli is its submodule)
    parser.add_argument("--version", action="version", version=f"vramledger {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     parser_class=_ArgumentParser)
    commands.required = True
    _replay_cli.register(commands)
    _snapshot_cli.register(commands, CliError)
    _guard_cli.register(commands, CliError)
    _run_cli.register(commands, CliError)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0; 1 from plan when the peak does not fit,
    from report --fail-on-flag, or from replay when the plan refused an allocation; 2 after
    printing an error)."""
    try:
        args = _parser().parse_args(argv)
        return args.run(args)
    except CliError as e:
        print(f"vramledger: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `vramledger replay ... | head`
        sys.stderr.close()
        return 0
    # Safety nets for what a command did not turn into a CliError itself (inputs that gave
    # tracebacks: a 100,000-deep JSON file, a 1e308 parameter count, a full disk).
    except RecursionError:
        print("vramledger: error: the input is nested too deeply to read or write",
              file=sys.stderr)
        return 2
    except OverflowError as e:
        print(f"vramledger: error: a number is out of range: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"vramledger: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
