"""`pcvr models`: the registered models with their parameter counts (total, tables, dense), built on the
meta device (no memory, even at 2.19B parameters).

    python -m pcvr_lib models                        # at the CPU smoke's settings (its table cap)
    python -m pcvr_lib models --reference-settings   # at the reference defaults, vs the reference's counts
    python -m pcvr_lib models --json

The reference's totals come from its smoke table (models-smoke.md), its classes built with each
experiment's defaults on the demo schema.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# the reference's parameter counts at its defaults on the demo schema
REFERENCE_PARAMETERS = {
    "baseline": 160.9e6,
    "interformer": 159_168_449,
    "onetrans": 544.7e6,
    "tokenformer": 159.0e6,
    "symbiosis": 85_013_529,
    "dualq": 546_653_709,
    "queryformer": 2_190_812_417,
}


def parameter_rows(schema_path: str | Path | None = None, reference_settings: bool = True,
                   models: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per model: total / tables / dense parameters at the chosen settings, and the reference's
    total with the relative difference (reference settings only)."""
    import torch

    from pcvr_lib.models import build_model, model_names
    from pcvr_lib.schema import load_schema
    from pcvr_lib.smoke import DEFAULT_SCHEMA, SMOKE_MODEL_CONFIG

    schema = load_schema(schema_path or DEFAULT_SCHEMA)
    overrides = {} if reference_settings else dict(SMOKE_MODEL_CONFIG)
    rows = []
    for name in models or model_names():
        with torch.device("meta"):
            model = build_model(name, schema, overrides)
        counts = model.parameter_counts()
        row = {"model": name, "total": counts["total"], "tables": counts["sparse"], "dense": counts["dense"],
               "settings": "reference" if reference_settings else "smoke", "overrides": overrides}
        if reference_settings and name in REFERENCE_PARAMETERS:
            ref = REFERENCE_PARAMETERS[name]
            row["reference_total"] = int(ref)
            row["relative_difference"] = (counts["total"] - ref) / ref
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    with_ref = any("reference_total" in r for r in rows)
    head = f"{'model':<12} {'total':>12} {'tables':>12} {'dense':>10}"
    if with_ref:
        head += f" {'reference':>12} {'diff':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['model']:<12} {r['total'] / 1e6:>11.2f}M {r['tables'] / 1e6:>11.2f}M {r['dense'] / 1e6:>9.2f}M"
        if "reference_total" in r:
            line += f" {r['reference_total'] / 1e6:>11.1f}M {100 * r['relative_difference']:>+6.2f}%"
        lines.append(line)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reference-settings", action="store_true",
                        help="the reference defaults (default: the CPU smoke's table cap)")
    parser.add_argument("--schema", help="schema JSON (default: fixtures/sample_1000_raw.schema.json)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run(args: argparse.Namespace) -> int:
    from pcvr_lib.schema import SchemaError

    if args.schema and not Path(args.schema).is_file():
        print(f"error: --schema {args.schema}: no such file", file=sys.stderr)
        return 2
    try:
        rows = parameter_rows(args.schema, reference_settings=args.reference_settings)
    except (SchemaError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        settings = "reference defaults" if args.reference_settings else f"smoke settings {rows[0]['overrides']}"
        print(f"parameters at {settings}, built on the meta device\n")
        print(format_table(rows))
    return 0
