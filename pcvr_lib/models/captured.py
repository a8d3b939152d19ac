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

from pcvr_lib.data.batch import Batch
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
    step from the model's and the optimizers' present state: the warm-up's updates are undone in place (the
    weights and buffers copied back; optimizer state that existed before copied back, state the warm-up
    created reset to a fresh optimizer's) and the random state is restored. Where
    the warm-up or the capture fails, the model and the optimizers are put back the same way before the
    error propagates, so the caller can go on eagerly from where it was."""
    problem = capture_problem(optimizers)
    if problem:
        raise ValueError(f"capture_training: {problem}")
    state = model.state_dict()  # detached tensors sharing the parameters' and buffers' memory
    saved = {name: tensor.clone() for name, tensor in state.items()}
    # the optimizers' state as it is now (empty for a fresh optimizer; a resumed or running one has some)
    saved_optim = [(per_param, {k: v.clone() if torch.is_tensor(v) else v for k, v in per_param.items()})
                   for opt in optimizers.optimizers for per_param in opt.state.values()]

    def restore():
        with torch.no_grad():
            for name, tensor in state.items():
                tensor.copy_(saved[name])
            optimizers.reset_state_()  # what the warm-up created: a fresh optimizer's values
            for per_param, values in saved_optim:
                for key, value in values.items():
                    if torch.is_tensor(value):
                        per_param[key].copy_(value)
                    else:
                        per_param[key] = value

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        try:
            return StepGraph(run, restore)
        except BaseException:
            if cuda:
                torch.cuda.synchronize(device)  # the side stream's warm-up may still be writing
            restore()
            optimizers.zero_grad(set_to_none=True)
            raise


def same_layout(a: Batch, b: Batch) -> bool:
    """Whether two batches have tensors of the same shapes and dtypes (what a captured graph needs)."""
    ta, tb = a.tensors(), b.tensors()
    return len(ta) == len(tb) and all((x.shape, x.dtype) == (y.shape, y.dtype) for x, y in zip(ta, tb, strict=True))


def copy_batch_(static: Batch, new: Batch) -> None:
    """`new` copied into the memory of `static` (same layout: `same_layout`)."""
    for a, b in zip(static.tensors(), new.tensors(), strict=True):
        a.copy_(b, non_blocking=True)


class CapturedTraining:
    """Training steps of `model` with `optimizers` as one CUDA graph: `step(batch)` runs one eager step on
    `batch` and returns what it returns (device tensors, read nothing back). The first batch of `rows` rows
    (any, when None) captures it on a copy of itself (`capture_training`); every later batch of that layout
    is copied into that copy and the graph replayed; a batch of another layout (a short last batch of a row
    group) runs eagerly on the same weights and optimizer state. Replay results are the graph's own tensors:
    read them before the next call."""

    def __init__(self, model: nn.Module, optimizers: OptimizerSet, step: Callable[[Batch], dict],
                 rows: int | None = None):
        self.model, self.optimizers, self.step, self.rows = model, optimizers, step, rows
        self.graph: StepGraph | None = None
        self.static: Batch | None = None
        self.eager_steps = 0  # batches of another layout than the captured one

    def __call__(self, batch: Batch) -> dict:
        if self.graph is None:
            if self.rows is not None and batch.batch_size != self.rows:
                self.eager_steps += 1
                return self.step(batch)
            static = batch.map(torch.clone)
            self.graph = capture_training(self.model, self.optimizers, lambda: self.step(static))
            self.static = static
        elif not same_layout(self.static, batch):
            self.eager_steps += 1
            return self.step(batch)
        else:
            copy_batch_(self.static, batch)
        return self.graph.replay()
