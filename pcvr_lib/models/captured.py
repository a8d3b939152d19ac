"""A whole training step, or an inference pass, captured as one CUDA graph (torch.cuda.graph) and replayed
per call: mode "captured" of `models.step.ModelStep`.

The eager step (forward, BCE loss, backward, the global grad-norm clip, fused AdamW, sparse Adagrad) reads
nothing back from the device at the static sequence lengths (`sequences.at_static_lengths`; CPU tests count
it), and every tensor it makes has a shape fixed by the batch's, so it can be captured as it runs: one
launch per call instead of thousands. What a capture fixes:

- the batch's memory: a replay reads the tensors the step was captured on (copy a new batch into them);
- the learning rates and every other Python number the optimizers pass to their kernels (a schedule needs
  a new capture);
- the optimizers' state: made by the warm-up runs on a side stream (which also compile and autotune the
  kernels), then reset in place together with the parameters (`OptimizerSet.reset_state_`), so the first
  replay is the first step from the state the step was built with.
The random state is left as it was before the capture, and a replay draws the numbers an eager call from
that state would (torch registers the generator with the graph).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pcvr_lib.optim import OptimizerSet, SparseAdagrad

WARMUP_RUNS = 3  # torch's advice for a capture: a few eager runs on a side stream first


def capture_problem(optimizers: OptimizerSet) -> str | None:
    """Why these optimizers cannot be captured in a graph (None when they can)."""
    dense = optimizers.dense
    if dense is not None:
        fused = isinstance(dense, torch.optim.AdamW) and all(g.get("fused") and g.get("capturable")
                                                              for g in dense.param_groups)
        if not fused:
            return (f"the dense optimizer {type(dense).__name__} is not capturable: use fused_adamw with "
                    "capturable=True (its step count stays on the device)")
    sparse = optimizers.sparse
    if sparse is not None and not isinstance(sparse, SparseAdagrad):
        return f"the sparse optimizer {type(sparse).__name__} is not capturable: use sparse_adagrad"
    return None


class StepGraph:
    """`run()` captured as one CUDA graph after `warmup` eager runs on a side stream; `restore()`, when
    given, runs between the warm-up and the capture (it may undo what the warm-up changed, in place).
    `replay()` runs the graph and returns what `run()` returned during the capture: the same tensors at
    every replay, so copy what must outlive the next one."""

    def __init__(self, run: Callable[[], object], restore: Callable[[], None] | None = None,
                 warmup: int = WARMUP_RUNS):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run()
        torch.cuda.current_stream().wait_stream(side)
        if restore is not None:
            restore()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = run()

    def replay(self):
        self.graph.replay()
        return self.output


def capture_training(model: nn.Module, optimizers: OptimizerSet, run: Callable[[], object]) -> StepGraph:
    """`run` (one training step of `model` with `optimizers`) as a StepGraph whose first replay takes the
    step from the model's and the optimizers' present state: the warm-up's updates are undone (the weights
    and buffers copied back, the optimizer state reset in place) and the random state is restored."""
    problem = capture_problem(optimizers)
    if problem:
        raise ValueError(f"capture_training: {problem}")
    state = model.state_dict()  # detached tensors sharing the parameters' and buffers' memory
    saved = {name: tensor.clone() for name, tensor in state.items()}

    def restore():
        with torch.no_grad():
            for name, tensor in state.items():
                tensor.copy_(saved[name])
        optimizers.reset_state_()

    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device]):
        return StepGraph(run, restore)
