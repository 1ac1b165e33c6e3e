"""The capacity benchmark (python -m benchmarks.capacity): the largest batch and sequence each
allocator trains under a cap on memory. __main__.py says how to run it."""

import argparse
import os
import sys
from typing import Callable, Iterable

# The exit status of a command that refuses what it was given, flags or files it cannot use, as
# argparse's refusals and the capacity command's: 2. Status 1 says it ran and something failed.
REFUSED = 2


def refuse(prog: str, message: str) -> int:
    """Prints `prog: message` on stderr and returns REFUSED, for a command's main() to return."""
    print(f"{prog}: {message}", file=sys.stderr)
    return REFUSED


def check_files(ap: argparse.ArgumentParser, paths: Iterable[str]) -> None:
    """ap.error() (status 2) naming the first of `paths` that is not a file, and why."""
    for path in paths:
        if not os.path.isfile(path):
            ap.error(f"{path}: " + ("not a file" if os.path.exists(path) else "no such file"))


def exit_with(main: Callable[[], int]) -> None:
    """Exits with main()'s status. A reader that stops early (`| head`) closes the pipe under the
    table being printed: that ends the command quietly, status 1, without a traceback (stdout
    goes to /dev/null so the interpreter's last flush cannot fail again)."""
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 1
    sys.exit(status)
