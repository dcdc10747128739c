"""The command line: ``python -m shared_td <command>`` or ``shared-td <command>``.

Each command lives in its own module with ``add_arguments(parser)``, ``run(args) -> int``
and an ``EPILOG`` of examples. A command's module is imported only when that command
runs (so ``shared-td --help`` is quick and one broken command cannot break the others).

Exit codes: 0 success, 1 failure (one line on stderr, the traceback only with
``--debug``), 2 usage error, 130 interrupted (Ctrl-C, also while starting: one line).

Examples:
    >>> from shared_td.cli import main
    >>> main(["verify", "data/buffer"])  # doctest: +ELLIPSIS
    ok: .../data/buffer: 2 nodes, 3 leaves (...), 0 non-tensor values
    0
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from shared_td.cli.common import CommandError, UsageError, one_line, shown
from shared_td.cli.startup import INTERRUPTED, started

PROG = "shared-td"

#: name -> (module, one-line summary). The summaries are here so that listing the
#: commands imports none of them.
COMMANDS = {
    "inspect": ("shared_td.cli.inspect_cmd", "show the tree of a saved tensordict (metadata only)"),
    "verify": ("shared_td.cli.verify_cmd", "check a saved tensordict's files against its meta.json"),
    "gc": ("shared_td.cli.gc_cmd", "remove what killed atomic writers left (temporary directories, stale locks)"),
    "bench": ("shared_td.cli.bench_cmd", "benchmarks: shared_td vs tensordict 0.15.3 vs the raw OS"),
    "demo": ("shared_td.cli.demo", "a short demonstration: processes sharing tensordicts"),
}

EXAMPLES = f"""examples:
  {PROG} inspect /data/buffer          the keys, shapes, dtypes and sizes of a save
  {PROG} verify /data/buffer           exit code 0 if it would load, 1 if not
  {PROG} gc --dry-run /data            what killed writers left under /data
  {PROG} bench --quick                 a short run of every benchmark case
  {PROG} COMMAND --help                the options and examples of a command
"""


class DemoUnavailable(Exception):
    """shared_td.cli.demo is not in this build."""


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (never raises, except with ``--debug``)."""
    started()  # a Ctrl-C is a KeyboardInterrupt again, caught below (see cli.startup)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_of(argv)
    debug = "--debug" in argv
    try:
        args = build_parser(command).parse_args(argv)
    except SystemExit as exit:  # argparse: --help, --version (0) or a usage error (2)
        return exit.code if isinstance(exit.code, int) else 0
    except DemoUnavailable:
        print(f"{PROG} demo: the demo is not available in this build", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # while the command's module (torch with it) is imported
        print(f"{PROG}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as error:  # a command module that fails to import
        return _failed(command, error, debug)
    try:
        return args.run(args)
    except UsageError as error:
        print(f"{PROG} {args.command}: usage error: {shown(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # `shared-td inspect x | head`: the reader left, not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:  # every failure: one line, the traceback on request
        return _failed(args.command, error, debug)


def _failed(command: str | None, error: Exception, debug: bool) -> int:
    """Report a failure on one line of stderr (and the traceback with --debug); 1."""
    if debug:
        traceback.print_exc()
    # one line whatever the error says; names in it cannot drive the terminal
    message = shown(one_line(error))
    if not isinstance(error, CommandError) and isinstance(error, (ImportError, AssertionError)):
        message = f"{type(error).__name__}: {message}"  # a bug, not a user's mistake
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return 1


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to add its arguments."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, check and clean up tensordicts saved by shared_td or "
        "tensordict 0.15.3, and measure shared_td against them.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, summary) in COMMANDS.items():
        if name != command:  # listed for --help, not imported
            commands.add_parser(name, help=summary)
            continue
        module = _import_command(name, module_name)
        sub = commands.add_parser(
            name, help=summary, description=summary,
            epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        # SUPPRESS: without --debug here, the top-level value is kept
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the traceback of an error")
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def _import_command(name: str, module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if name == "demo" and error.name == module_name:
            raise DemoUnavailable() from None
        raise


def _command_of(argv: list[str]) -> str | None:
    """The command word: the first argument that is not an option (top-level options
    take no value)."""
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def _version() -> str:
    from shared_td import __version__

    return __version__
