"""`pcvr inspect FILE --schema S [--json] [--verify]`: what a PCVR parquet file holds, read row group by
row group (bounded memory).

Reports rows, row groups, bytes (file, compressed and uncompressed column data); per sequence domain the
share of rows whose lists are newest first, newest last, not monotonic or too short to tell (the
converter's own per-row rule, `convert.classify_list_order`), and length percentiles; per column the nulls
(null rows, and null elements inside lists) and out-of-vocabulary values (ids >= vocab_size, vocab > 0); the
values train, val and infer warn about or refuse (`parquet.ValueCounts`: null labels, NaN / infinite dense
values, negative request timestamps). A file whose own schema differs from --schema is refused, as by train.
`--verify` also decodes every column chunk of every row group, the columns the schema does not use
included, and names each one that fails (exit status 1).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pcvr_lib.data.convert import ORDER_CLASSES, classify_list_order
from pcvr_lib.data.parquet import DataError, ValueCounts, check_data_schema, open_dataset
from pcvr_lib.progress import interactive
from pcvr_lib.schema import Schema, load_schema

PERCENTILES = (50, 90, 95, 99)


def _vocab_columns(schema: Schema) -> dict[str, int]:
    """Id columns with a vocabulary (the ones out-of-vocab counts apply to)."""
    out = {f.column: f.vocab_size for f in schema.user_int + schema.item_int}
    for domain in schema.domains:
        out.update({f.column: f.vocab_size for f in domain.side_features})
    return {name: vocab for name, vocab in out.items() if vocab > 0}


def inspect_file(path: str | Path, schema: Schema, *, verify: bool = False, progress: bool = False) -> dict:
    """The report as a dict (see the module doc)."""
    path = Path(path)
    parquet = open_dataset(path, schema)
    check_data_schema(path, schema, "the schema given (--schema)", "inspect it with its own schema")
    value_counts = ValueCounts()
    meta = parquet.metadata
    columns = schema.converter_columns
    vocab = _vocab_columns(schema)
    nulls = dict.fromkeys(columns, 0)
    null_elements = dict.fromkeys(columns, 0)
    oob = dict.fromkeys(vocab, 0)
    orders = {d.name: dict.fromkeys(ORDER_CLASSES, 0) for d in schema.domains}
    lengths: dict[str, list[np.ndarray]] = {d.name: [] for d in schema.domains}
    corrupt: list[dict] = []
    groups = range(meta.num_row_groups)
    if progress:
        from tqdm import tqdm

        groups = tqdm(groups, unit="row group", desc=f"inspect {path.name}")
    for g in groups:
        try:
            table = parquet.read_row_group(g, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            if not verify:
                raise DataError(
                    f"{path}: row group {g} cannot be decoded: {type(exc).__name__}: {exc} "
                    "(--verify names every failing column chunk)"
                ) from exc
            corrupt.append({"row_group": g, "column": None, "error": f"{type(exc).__name__}: {exc}"})
            continue
        value_counts.add(table, schema, int(sum(meta.row_group(i).num_rows for i in range(g))))
        for name in columns:
            col = table.column(name)
            nulls[name] += col.null_count
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                values = pc.list_flatten(col)
                null_elements[name] += values.null_count
            else:
                values = col
            if name in vocab:
                oob[name] += int(pc.sum(pc.greater_equal(values, vocab[name])).as_py() or 0)
        for domain in schema.domains:
            ts = table.column(domain.ts_feature.column).combine_chunks()
            cls = classify_list_order(ts)
            for i, n in enumerate(np.bincount(cls, minlength=len(ORDER_CLASSES)).tolist()):
                orders[domain.name][ORDER_CLASSES[i]] += n
            lengths[domain.name].append(pc.fill_null(pc.list_value_length(ts), 0).to_numpy())
        if verify:  # every other column too, one by one, so a failure names its column
            for name in parquet.schema_arrow.names:
                if name in columns:
                    continue
                try:
                    parquet.read_row_group(g, columns=[name])
                except (OSError, pa.ArrowException) as exc:
                    corrupt.append({"row_group": g, "column": name, "error": f"{type(exc).__name__}: {exc}"})
    if verify:  # a failed group: find its failing columns
        for entry in [c for c in corrupt if c["column"] is None]:
            for name in columns:
                try:
                    parquet.read_row_group(entry["row_group"], columns=[name])
                except (OSError, pa.ArrowException) as exc:
                    corrupt.append({"row_group": entry["row_group"], "column": name, "error": str(exc)})
            corrupt.remove(entry)

    rows = meta.num_rows
    groups_meta = [meta.row_group(g) for g in range(meta.num_row_groups)]
    domains = {}
    for domain in schema.domains:
        lens = np.concatenate(lengths[domain.name]) if lengths[domain.name] else np.zeros(0, dtype=np.int64)
        counted = orders[domain.name]
        total = sum(counted.values())
        domains[domain.name] = {
            "max_len": domain.max_len,
            "list_order_rows": counted,
            "list_order_share": {k: (v / total if total else 0.0) for k, v in counted.items()},
            "length": {
                "mean": float(lens.mean()) if len(lens) else 0.0,
                **{f"p{q}": float(np.percentile(lens, q)) if len(lens) else 0.0 for q in PERCENTILES},
                "max": int(lens.max()) if len(lens) else 0,
                "share_longer_than_max_len": float((lens > domain.max_len).mean()) if len(lens) else 0.0,
            },
        }
    return {
        "file": str(path),
        "rows": rows,
        "row_groups": meta.num_row_groups,
        "rows_per_group": {"min": min(g.num_rows for g in groups_meta), "max": max(g.num_rows for g in groups_meta)},
        "bytes": path.stat().st_size,
        "compressed_bytes": sum(g.column(i).total_compressed_size for g in groups_meta for i in range(g.num_columns)),
        "uncompressed_bytes": sum(g.total_byte_size for g in groups_meta),
        "columns_in_file": meta.num_columns,
        "columns_used": len(columns),
        "domains": domains,
        "null_rows": {k: v for k, v in nulls.items() if v},
        "null_elements": {k: v for k, v in null_elements.items() if v},
        "out_of_vocab": {k: v for k, v in oob.items() if v},
        "values": value_counts.to_dict(),
        "verified": verify,
        "corrupt": corrupt,
    }


def _print(report: dict) -> None:
    print(
        f"{report['file']}: {report['rows']:,} rows in {report['row_groups']} row groups "
        f"({report['rows_per_group']['min']:,}-{report['rows_per_group']['max']:,} rows each), "
        f"{report['bytes']:,} bytes ({report['uncompressed_bytes']:,} uncompressed), "
        f"{report['columns_used']} of {report['columns_in_file']} columns used"
    )
    print(f"{'domain':<10}{'newest first':>14}{'newest last':>13}{'not monotonic':>15}{'too short':>11}"
          f"{'mean len':>10}{'p50':>7}{'p95':>7}{'p99':>7}{'max':>7}{'> L':>7}")  # fmt: skip
    for name, d in report["domains"].items():
        s, n = d["list_order_share"], d["length"]
        print(
            f"{name:<10}{s['newest_first']:>14.1%}{s['newest_last']:>13.1%}{s['non_monotonic']:>15.1%}"
            f"{s['too_short']:>11.1%}{n['mean']:>10.1f}{n['p50']:>7.0f}{n['p95']:>7.0f}{n['p99']:>7.0f}"
            f"{n['max']:>7}{n['share_longer_than_max_len']:>7.1%}"
        )
    titles = (("null rows", "null_rows"), ("null elements", "null_elements"), ("out of vocab", "out_of_vocab"))
    for title, key in titles:
        counts = report[key]
        shown = ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:8])
        more = f" and {len(counts) - 8} more column(s)" if len(counts) > 8 else ""
        print(f"{title}: {sum(counts.values()):,} in {len(counts)} column(s)" + (f": {shown}{more}" if counts else ""))
    v = report["values"]
    first = v["first_negative_timestamp"]
    print(f"null labels: {v['null_labels']:,} (read as negative)")
    print(f"negative request timestamps: {v['negative_timestamps']:,}"
          + (f" (first in row {first[0]}: {first[1]}; train, val and infer refuse them)" if first else ""))
    dense = v["non_finite_dense"]
    shown = ", ".join(f"{k} {n:,}" for k, n in sorted(dense.items(), key=lambda kv: -kv[1])[:8])
    more = f" and {len(dense) - 8} more column(s)" if len(dense) > 8 else ""
    print(f"NaN / infinite dense values: {sum(dense.values()):,} in {len(dense)} column(s) (read as missing)"
          + (f": {shown}{more}" if dense else ""))
    if report["verified"]:
        if report["corrupt"]:
            for c in report["corrupt"]:
                print(f"CORRUPT row group {c['row_group']} column {c['column']}: {c['error']}")
        else:
            print("verify: every column chunk of every row group decodes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="parquet file")
    parser.add_argument("--schema", required=True, help="schema JSON (raw_parquet format)")
    parser.add_argument("--max-lens", help="sequence lengths, e.g. seq_a:64,seq_b:64 (default: schema defaults)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--verify", action="store_true", help="decode every page of every column")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (none is shown off a terminal)")


def run(args: argparse.Namespace) -> int:
    # errors (DataError, SchemaError, a missing file) go to the command line's boundary: `pcvr inspect: error: ...`
    schema = load_schema(args.schema, args.max_lens)
    progress = not args.no_progress and not args.json and interactive()  # no bar in logs or CI
    report = inspect_file(args.file, schema, verify=args.verify, progress=progress)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 1 if report["corrupt"] else 0
