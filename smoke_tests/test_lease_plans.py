"""What a device call needs before it starts: every node id it runs from a plan file in tools/lease/plans/ is a
benchmark case that pytest collects (a renamed parameter would make the call's pytest stop at "not found" after
its build time), and the tracked tree leaves room in the call's 64 MiB for what it carries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from smoke_tests.test_code_hygiene import tracked_files

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
# A device call takes at most 64 MiB of working tree; it carries TileLang's site (about 43 MiB, .gpu-site/) and the
# precompiled kernel pack (about 5 MiB, .cache/tlpack/), and the runs it brings back get committed.
TRACKED_BUDGET = 14 * MiB
PLANS = sorted((ROOT / "tools/lease/plans").glob("*.txt"))


def test_every_plan_id_is_a_collected_case():
    assert PLANS, "tools/lease/plans/ holds the lease scripts' plan files"
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "perf_tests/test_models.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    known = {line.strip() for line in collected.stdout.splitlines() if "::" in line}
    for plan in PLANS:
        ids = [line.strip() for line in plan.read_text().splitlines() if line.strip()]
        assert ids, f"{plan.name} is empty"
        assert len(ids) == len(set(ids)), f"{plan.name} names an id twice"
        missing = [i for i in ids if i not in known]
        assert not missing, f"{plan.name}: not collected: {missing}"


def test_the_tracked_tree_leaves_room_for_the_carried_site():
    sizes = {name: (ROOT / name).stat().st_size for name in tracked_files() if (ROOT / name).is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert total <= TRACKED_BUDGET, (
        f"tracked files take {total / MiB:.1f} MiB, over the {TRACKED_BUDGET / MiB:.0f} MiB that leaves a device call "
        f"room for .gpu-site and .cache/tlpack; gzip archived runs (gzip -9n; pcvr reads .json.gz). Largest: {largest}")
