"""Merge a new benchmark run into a committed snapshot whose cases come from several device calls.

    python3 tools/merge_snapshot.py .benchmarks/h200/models.json $OUT/models.json \
        --tree COMMIT --command "MODELS_IDS=... bash tools/h200_session.sh perf_models"

The new run's cases replace the snapshot's cases of the same name; the snapshot's other cases stay as they
are (each keeps its own `extra_info.measured_tree` and source digest, so `pcvr report` still marks it stale
where its code changed). A case the new run timed leaves the snapshot's `failed` list; a case that failed in
the new run replaces an older timing of it (the code it describes no longer passes its check). The run is
appended to `merged_runs` (command, tree, how many cases it finished and failed). Both files must come from
the same kind of machine (GPU and CPU as `machine_info` names them); a cut run gives its finished
cases, a file without cases is refused.

    python3 tools/merge_snapshot.py .benchmarks/h200/models.json --retire-stale .benchmarks/h200/models_retired.json

moves every case whose library sources changed since it ran (`pcvr report`'s `stale`) out of the snapshot into
the archive (a case already there is replaced), so that the snapshot, which the README quotes, holds only
numbers of this tree's code; the archive keeps the older numbers for reading. Either a run or --retire-stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class MergeError(Exception):
    pass


def _machine(run: dict) -> tuple:
    info = run.get("machine_info") or {}
    gpu = (info.get("gpu") or {}).get("name") if isinstance(info.get("gpu"), dict) else info.get("gpu")
    return gpu, info.get("cpu", {}).get("brand_raw") if isinstance(info.get("cpu"), dict) else info.get("cpu")


def _load(path: Path, what: str) -> dict:
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MergeError(f"{what} {path}: not a readable benchmark JSON ({exc})") from exc
    if not isinstance(run, dict) or not isinstance(run.get("benchmarks"), list):
        raise MergeError(f"{what} {path}: no 'benchmarks' list (a pytest-benchmark JSON is expected)")
    return run


def merge(base: dict, new: dict, *, tree: str, command: str) -> dict:
    """The snapshot `base` with `new`'s cases in (see the module docstring); `base` is not modified."""
    if _machine(base) != _machine(new):
        raise MergeError(f"the runs come from different machines ({_machine(base)} vs {_machine(new)}): "
                         "merge only runs of one machine kind")
    if not new["benchmarks"] and not new.get("failed"):
        raise MergeError("the new run has no case, timed or failed: nothing to merge")
    out = json.loads(json.dumps(base))
    timed = {b["name"]: b for b in new["benchmarks"]}
    failed_now = dict(new.get("failed") or {})
    failed_names = {name.rsplit("::", 1)[-1] for name in failed_now}
    for b in timed.values():
        b.setdefault("extra_info", {})["measured_tree"] = tree
    kept = [b for b in out["benchmarks"] if b["name"] not in timed and b["name"] not in failed_names]
    out["benchmarks"] = kept + list(timed.values())
    failed = {name: why for name, why in (out.get("failed") or {}).items() if name.rsplit("::", 1)[-1] not in timed}
    failed.update(failed_now)
    out["failed"] = failed
    # why a case has no figure (a peer not installed): the newest word on each case; a timed one has its figure
    skipped = {name: why for name, why in (out.get("skipped") or {}).items() if name.rsplit("::", 1)[-1] not in timed}
    skipped.update(new.get("skipped") or {})
    out["skipped"] = skipped
    out["source_files"] = {**(out.get("source_files") or {}), **(new.get("source_files") or {})}
    runs = list(out.get("merged_runs") or [])
    runs.append({"command": command, "tree": tree, "finished": len(timed), "failed": len(failed_now),
                 "kept": "all", "datetime": new.get("datetime")})
    out["merged_runs"] = runs
    trees = sorted({b.get("extra_info", {}).get("measured_tree", "?") for b in out["benchmarks"]})
    out.setdefault("commit_info", {})["measured_tree"] = (
        f"per case in extra_info.measured_tree: {', '.join(trees)}; the newest merge {tree}")
    out["datetime"] = new.get("datetime", out.get("datetime"))
    return out


def retire_stale(snapshot: dict, archive: dict | None) -> tuple[dict, dict, int]:
    """(the snapshot without its stale cases, the archive with them, how many moved); neither input is modified."""
    from pcvr_lib import sources

    recorded = snapshot.get("source_files") or {}
    return retire(snapshot, archive,
                  lambda b: sources.case_state(b.get("extra_info") or {}, recorded)["state"] == sources.STALE,
                  "its library sources changed after it ran")


def retire(snapshot: dict, archive: dict | None, select, why: str) -> tuple[dict, dict, int]:
    """(the snapshot without the cases `select(case)` picks, the archive with them, each with `why` in its
    extra_info.retired_why, how many moved); neither input is modified."""
    out = json.loads(json.dumps(snapshot))
    recorded = out.get("source_files") or {}
    picked = [b for b in out["benchmarks"] if select(b)]
    moved = {b["name"] for b in picked}
    out["benchmarks"] = [b for b in out["benchmarks"] if b["name"] not in moved]
    for b in picked:
        b.setdefault("extra_info", {})["retired_why"] = why
    if archive is None:
        archive = {key: value for key, value in out.items() if key not in ("benchmarks", "failed", "merged_runs")}
        archive["benchmarks"] = []
    archive = json.loads(json.dumps(archive))
    if _machine(archive) != _machine(out):
        raise MergeError(f"the archive comes from another machine ({_machine(archive)} vs {_machine(out)})")
    archive["benchmarks"] = [b for b in archive["benchmarks"] if b["name"] not in moved] + picked
    archive["source_files"] = {**(archive.get("source_files") or {}), **recorded}
    archive["note"] = ("cases retired from the snapshot beside this file, each with extra_info.retired_why (older "
                       "trees' sources, or a measurement found wrong): kept for reading, not quoted anywhere")
    return out, archive, len(picked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", type=Path, help="the committed snapshot (rewritten unless --out)")
    parser.add_argument("run", type=Path, nargs="?", help="the new run's benchmark JSON")
    parser.add_argument("--tree", help="the tree the new run measured (a commit; with a run)")
    parser.add_argument("--command", help="the command that made the new run (with a run)")
    parser.add_argument("--out", type=Path, help="where to write the merged snapshot (default: over snapshot)")
    parser.add_argument("--retire-stale", type=Path, metavar="ARCHIVE",
                        help="instead of merging a run: move the snapshot's stale cases into ARCHIVE")
    args = parser.parse_args(argv)
    if (args.run is None) == (args.retire_stale is None):
        parser.error("give either a run to merge or --retire-stale ARCHIVE")
    if args.run is not None and not (args.tree and args.command):
        parser.error("merging a run needs --tree and --command")
    if args.retire_stale is not None:
        return _retire(args.snapshot, args.retire_stale, args.out or args.snapshot)
    try:
        base, new = _load(args.snapshot, "snapshot"), _load(args.run, "run")
        if new.get("cut"):
            print(f"merge_snapshot: note: {args.run} was cut ({new['cut']}); its finished cases are merged",
                  file=sys.stderr)
        merged = merge(base, new, tree=args.tree, command=args.command)
    except MergeError as exc:
        print(f"merge_snapshot: {exc}", file=sys.stderr)
        return 2
    out = args.out or args.snapshot
    out.write_text(json.dumps(merged, indent=2) + "\n")
    print(f"{out}: {len(merged['benchmarks'])} cases ({merged['merged_runs'][-1]['finished']} from {args.run}), "
          f"{len(merged['failed'])} failed")
    return 0


def _retire(path: Path, archive_path: Path, out: Path) -> int:
    try:
        snapshot = _load(path, "snapshot")
        archive = _load(archive_path, "archive") if archive_path.exists() else None
        kept, archive, moved = retire_stale(snapshot, archive)
    except MergeError as exc:
        print(f"merge_snapshot: {exc}", file=sys.stderr)
        return 2
    out.write_text(json.dumps(kept, indent=2) + "\n")
    archive_path.write_text(json.dumps(archive, indent=2) + "\n")
    print(f"{out}: {len(kept['benchmarks'])} cases; {moved} stale moved to {archive_path} "
          f"({len(archive['benchmarks'])} there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
