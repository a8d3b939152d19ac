"""`pcvr` / `python -m pcvr_lib`: one command line, one subcommand per module, one error boundary.

Adding a command is one COMMANDS line: the module defines `add_arguments(parser)` and `run(args) -> int`
(or `add_<command>_arguments` / `run_<command>` when one module serves several commands). Modules are
imported only when their subcommand runs, so `pcvr generate` does not pay for importing the models.

The error boundary (`main`) is the only place that turns exceptions into exit codes, so every command
fails the same way:
- bad input (a ValueError such as SchemaError, DataError, LoaderError, TrainError, ...; an OSError such
  as a missing, locked or unreadable path; a module's own KNOWN_ERRORS) prints one line
  `pcvr <command>: error: <what, where>` on stderr and exits 2;
- Ctrl-C exits 130 with `pcvr <command>: interrupted` and, when the command says it, where it stopped;
- anything else is a bug: one line naming the exception type, exit 1;
- `--debug` (or PCVR_DEBUG=1) prints the full traceback instead, for either kind.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from pcvr_lib.errors import CommandError, Interrupted

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("pcvr_lib.data.generate", "write demo-like PCVR parquet data from a schema"),
    "inspect": ("pcvr_lib.data.inspect_file", "what a parquet file holds: rows, list order, nulls, out-of-vocab"),
    "report": ("pcvr_lib.report", "print a benchmark JSON file as a table (--view ...) and its sources state"),
    "diff": ("pcvr_lib.compare.diff", "compare two stored benchmark runs against the noise floor (exit 1: regressed)"),
    "noise": ("pcvr_lib.compare.noise", "run the suite N times (or read runs) and store the noise floor"),
    "compare": ("pcvr_lib.compare.interleaved",
                "interleaved A-B-B-A runs of a base tree and this one, with bootstrap intervals"),
    "train": ("pcvr_lib.train.commands", "train a PCVR model: checkpoints, training_summary/telemetry JSON"),
    "val": ("pcvr_lib.train.commands", "evaluate a checkpoint: evaluation.json, validation_predictions.jsonl"),
    "infer": ("pcvr_lib.train.commands", "score every row with a checkpoint: predictions.json"),
    "plot-diagnostics": ("pcvr_lib.diagnostics", "the five smoke diagnostic figures + summary JSON"),
    "smoke": ("pcvr_lib.smoke", "every model x seed: train, val, infer, then the diagnostics"),
    "models": ("pcvr_lib.model_counts", "the registered models' parameter counts (total, tables, dense)"),
}

EXIT_ERROR = 2  # bad input, refused request (argparse uses 2 too)
EXIT_BUG = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


class _Parser(argparse.ArgumentParser):
    """argparse with the boundary's one-line error form (argparse prints the usage first)."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("pcvr-bench")
    except metadata.PackageNotFoundError:  # a checkout run without an install
        from pcvr_lib import __version__

        return __version__


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print the full traceback instead of one line (also PCVR_DEBUG=1)")
    parser = _Parser(prog="pcvr", description="pcvr-bench command line", parents=[common])
    parser.add_argument("--version", action="version", version=f"pcvr {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        if name == command:
            module = importlib.import_module(module_name)
            adder = getattr(module, f"add_{name.replace('-', '_')}_arguments", None) or module.add_arguments
            adder(sub_parser)
    return parser


def is_known_error(exc: BaseException, module=None) -> bool:
    """Bad input as the library reports it: ValueError (and its many subclasses), OSError, a damaged
    safetensors file, or one of the command module's KNOWN_ERRORS."""
    known: tuple[type, ...] = (CommandError, ValueError, OSError, *getattr(module, "KNOWN_ERRORS", ()))
    if isinstance(exc, known):
        return True
    return type(exc).__name__ == "SafetensorError"  # not importable without safetensors; name is stable


def error_text(exc: BaseException) -> str:
    """One line: an OSError as `path: reason`, anything else as its message (never empty)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror[0].lower()}{exc.strerror[1:]}"
    else:
        text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())  # multi-line messages (pyarrow's) folded into one line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    debug = getattr(args, "debug", False) or os.environ.get("PCVR_DEBUG", "") not in ("", "0")
    prog = f"pcvr {args.command}"
    module = None
    try:
        module = importlib.import_module(COMMANDS[args.command][0])
        runner = getattr(module, f"run_{args.command.replace('-', '_')}", None) or module.run
        return int(runner(args) or 0)
    except KeyboardInterrupt as exc:
        if debug:
            traceback.print_exc()
        detail = f": {exc}" if isinstance(exc, Interrupted) and str(exc) else ""
        print(f"{prog}: interrupted{detail}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug:
            traceback.print_exc()
        if is_known_error(exc, module):
            print(f"{prog}: error: {error_text(exc)}", file=sys.stderr)
            return EXIT_ERROR
        print(f"{prog}: internal error {type(exc).__name__}: {error_text(exc)} (a bug; rerun with --debug for "
              "the traceback and report it)", file=sys.stderr)
        return EXIT_BUG
