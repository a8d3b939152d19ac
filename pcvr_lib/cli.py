"""`pcvr` / `python -m pcvr_lib`: one command line, one subcommand per module.

Each module listed in COMMANDS defines `add_arguments(parser)` and `run(args) -> int`. Modules are
imported only when their subcommand runs, so `pcvr generate` does not pay for importing the models.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("pcvr_lib.data.generate", "write demo-like PCVR parquet data from a schema"),
    "report": ("pcvr_lib.report", "summarise a pytest-benchmark JSON file"),
    "compare": ("pcvr_lib.report", "run the perf suite and compare it with a stored run (regression gate)"),
    "train": ("pcvr_lib.train", "train a PCVR model: checkpoints, training_summary/telemetry JSON"),
    "val": ("pcvr_lib.train", "evaluate a checkpoint: evaluation.json, validation_predictions.jsonl"),
    "infer": ("pcvr_lib.train", "score every row with a checkpoint: predictions.json"),
    "plot-diagnostics": ("pcvr_lib.diagnostics", "the five smoke diagnostic figures + summary JSON"),
    "smoke": ("pcvr_lib.smoke", "every model x seed: train, val, infer, then the diagnostics"),
    "models": ("pcvr_lib.models.counts", "the registered models' parameter counts (total, tables, dense)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pcvr", description="pcvr-bench command line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            adder = getattr(module, f"add_{name.replace('-', '_')}_arguments", None) or module.add_arguments
            adder(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    runner = getattr(module, f"run_{args.command.replace('-', '_')}", None) or module.run
    return int(runner(args) or 0)
