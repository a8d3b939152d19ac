"""`pcvr_lib.heap`: with the freed heap kept, a training-like step that makes and frees the same large
temporaries reuses their pages instead of faulting in fresh ones (in a fresh interpreter: the setting is
process-wide)."""

import subprocess
import sys

import pytest

from pcvr_lib import heap

STEPS = """
import resource, torch
from pcvr_lib.heap import keep_freed_heap

torch.set_num_threads(1)
torch.manual_seed(0)
linear = torch.nn.Linear(256, 2048)
x = torch.randn(8192, 256)

def faults_of_a_step():  # 64 MiB activations and gradients: above glibc's largest mmap threshold (32 MiB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.nn.functional.silu(linear(x)).square().mean().backward()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = [faults_of_a_step() for _ in range(3)]
applied = keep_freed_heap()
kept = [faults_of_a_step() for _ in range(12)]
print(default[-1], min(kept[-6:]), applied)
"""


@pytest.mark.skipif(heap._glibc() is None, reason="the heap settings are glibc's; elsewhere they do nothing")
def test_a_repeated_step_reuses_its_pages(repo_root):
    """By default every step maps its large temporaries afresh (about 131k page faults a step here); with the
    heap kept, after a few steps that grow the heap to the step's high-water mark, a step faults in (next to)
    nothing. (Transparent huge pages on every mapping would cut both counts by 512: the bound allows for it.)"""
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, cwd=repo_root, check=True)
    default, kept, applied = out.stdout.split()
    default, kept = int(default), int(kept)
    assert applied == "True"
    assert kept <= max(64, default // 10), (default, kept)


def test_release_says_whether_it_applied():
    assert heap.release_free_heap() is (heap._glibc() is not None)
