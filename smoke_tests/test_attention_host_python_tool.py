"""tools/attention_host_python.py runs (in its own process: it patches the launcher) and reports the three
per-call times, with the forward and the one-tile backward as the launches a PCVR-shape fwd+bwd makes."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "attention_host_python.py"


def test_reports_the_three_times_and_the_launches():
    done = subprocess.run([sys.executable, str(TOOL), "--batch", "2", "--heads", "2", "--seq", "40", "--dim", "16",
                           "--calls", "50"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "['flash_attention.fwd', 'flash_attention.bwd_one_tile']" in done.stdout
    line = re.compile(r"^(fwd\+bwd|fwd|floor Function fwd\+bwd)\s+([0-9.]+) us per call", re.M)
    times = {m.group(1).strip(): float(m.group(2)) for m in line.finditer(done.stdout)}
    assert set(times) == {"fwd", "fwd+bwd", "floor Function fwd+bwd"} and all(t > 0 for t in times.values())
    assert times["fwd+bwd"] > times["fwd"]
