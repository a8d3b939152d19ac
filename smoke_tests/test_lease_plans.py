"""tools/lease/plans/: every node id a device call runs from a plan file is a benchmark case that pytest
collects (a renamed parameter would make the call's pytest stop at "not found" after its build time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
