"""`vramledger run [options] -- COMMAND`: runs an unmodified program with the LD_PRELOAD
shim libvramledger_preload.so (found beside this package, or $VRAMLEDGER_PRELOAD) and VRAMLEDGER_CONF."""

from __future__ import annotations

import os
import shutil

PRELOAD_NAME = "libvramledger_preload.so"
PRELOAD_ENV = "VRAMLEDGER_PRELOAD"  # overrides where the shim is looked for (in-tree runs)


def preload_path(cli_error: type[Exception]) -> str:
    """Absolute path of the shim: $VRAMLEDGER_PRELOAD, else the one in this package."""
    override = os.environ.get(PRELOAD_ENV)
    path = override or os.path.join(os.path.dirname(os.path.abspath(__file__)), PRELOAD_NAME)
    if not os.path.isfile(path):
        raise cli_error(f"run: the LD_PRELOAD shim {path} does not exist (a build without "
                        f"the CUDA toolkit?); set {PRELOAD_ENV} to a built one")
    return os.path.abspath(path)


def _check_conf(source: str, conf: str | None, cli_error: type[Exception]) -> None:
    """Raises `cli_error` naming `source` (the flag or the variable) when `conf` does not parse,
    or when its `plan:` file is missing or does not parse.

    The shim would refuse the same value at the program's start, but it sees only the joined
    VRAMLEDGER_CONF and cannot tell the user which of the two held the bad key. Skipped when
    the C++ extension is not built (the shim still checks)."""
    if not conf:
        return
    try:
        conf.encode("utf-8")
    except UnicodeEncodeError as e:  # a byte that is not UTF-8 (surrogate-escaped by Python)
        raise cli_error(f"run: {source}: not valid UTF-8 at character {e.start + 1}") from e
    try:
        from vramledger import _core  # the C++ extension (tools/python_module.cc)
    except ImportError:
        return
    try:
        options = _core.parse_options(conf)
    except ValueError as e:
        raise cli_error(f"run: {source}: {e}") from e
    if options.get("plan"):
        _check_plan(options["plan"], f"{source}: option 'plan'", cli_error)


def _check_plan(path: str, source: str, cli_error: type[Exception]) -> None:
    """Raises `cli_error` naming `source` (--plan, or the conf that set plan:) when the plan
    file is missing or does not parse (the shim would refuse it too, but blaming
    VRAMLEDGER_CONF, where this command puts it). Skipped when the plugin library, which holds
    the parser, is not there (the shim still checks)."""
    from vramledger import _guard
    try:
        _guard.check_plan(path)
    except (FileNotFoundError, ValueError) as e:
        raise cli_error(f"run: {source}: {e}") from e
    except RuntimeError as e:
        if _guard.library(required=False) is not None:  # the library is there: the file failed
            raise cli_error(f"run: {source}: {e}") from e


def run(args, cli_error: type[Exception]) -> int:
    """Sets LD_PRELOAD and VRAMLEDGER_CONF and execs the command (never returns on success)."""
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise cli_error("run: give the command after --")
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [preload_path(cli_error), env.get("LD_PRELOAD")]))
    _check_conf("VRAMLEDGER_CONF", env.get("VRAMLEDGER_CONF"), cli_error)
    args.conf = ",".join(c for c in args.conf if c)  # every --conf, in order
    _check_conf("--conf", args.conf, cli_error)
    conf = [c for c in (env.get("VRAMLEDGER_CONF"), args.conf) if c]
    if args.plan:
        _check_plan(args.plan, "--plan", cli_error)
        conf.append(f"plan:{os.path.abspath(args.plan)}")
    if args.dump_dir:
        conf.append(f"dump_dir:{os.path.abspath(args.dump_dir)}")
    if conf:
        env["VRAMLEDGER_CONF"] = ",".join(conf)
    if os.sep not in command[0] and shutil.which(command[0], path=env.get("PATH")) is None:
        raise cli_error(f"run: {command[0]}: command not found on PATH")
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        raise cli_error(f"run: cannot run {command[0]}: {e}") from e
    return 0


def register(commands, cli_error: type[Exception]) -> None:
    """Adds `run` to the `vramledger` subcommands; errors become `cli_error`."""
    p = commands.add_parser(
        "run", help="run an unmodified program with vramledger's LD_PRELOAD shim",
        description="Runs COMMAND with LD_PRELOAD=libvramledger_preload.so and VRAMLEDGER_CONF, "
                    "so its torch tensors (vramledger becomes torch's allocator as torch loads) "
                    "or, without torch, its cudaMalloc/cudaMallocAsync are served by vramledger. "
                    "A snapshot and summary are written to the dump directory at exit and on "
                    "SIGUSR1.")
    p.add_argument("--conf", action="append", default=[],
                   help="allocator options (key:value,...), appended to VRAMLEDGER_CONF; given "
                        "twice, both apply")
    p.add_argument("--plan", help="plan file the guard enforces")
    p.add_argument("--dump-dir", help="where snapshots, summaries and OOM dumps go")
    p.add_argument("cmd", nargs="...", metavar="-- COMMAND", help="the program and its arguments")
    p.set_defaults(run=lambda args: run(args, cli_error))
