"""CPU seconds of one smoke-sized training step per model: batch 128 of random rows, 32 events per domain,
tables capped at 8192 rows (the smoke's settings), one torch thread. Prints forward and backward+step
process CPU time of the third step (the first two warm up); process time, not wall time, so that other
jobs on the machine inflate it less.

    PYTHONPATH=. python3 tools/model_step_cpu.py [model,model,...] [--coo-tables]

--coo-tables keeps every table gradient in COO form (models.tables makes it dense where the batch reads a
table more often than it has rows): the step as it was before that rule, to measure what the rule saves.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from pcvr_lib.models import build_model, model_names, tables
from pcvr_lib.optim import build_optimizer_set, train_step
from pcvr_lib.smoke import DEFAULT_MAX_LEN, SMOKE_MODEL_CONFIG
from pcvr_lib.workloads.models import demo_schema, random_batch


def main() -> None:
    torch.set_num_threads(1)
    schema = demo_schema(DEFAULT_MAX_LEN)
    batch = random_batch(schema, batch=128, seed=0)
    args = [a for a in sys.argv[1:] if a != "--coo-tables"]
    if "--coo-tables" in sys.argv[1:]:
        tables.dense_gradient_pays = lambda pieces, num_rows: False
    names = args[0].split(",") if args else model_names()
    print(f"{'model':<12} {'forward s':>9} {'bwd+step s':>10} {'step s':>7}")
    for name in names:
        torch.manual_seed(0)
        model = build_model(name, schema, SMOKE_MODEL_CONFIG).train()
        optimizers = build_optimizer_set(model.dense_parameters(), model.sparse_parameters())
        for _ in range(3):
            t0 = time.process_time()
            loss = F.binary_cross_entropy_with_logits(model(batch)[:, 0], batch.label)
            t1 = time.process_time()
            train_step(loss, optimizers)
            t2 = time.process_time()
        print(f"{name:<12} {t1 - t0:>9.2f} {t2 - t1:>10.2f} {t2 - t0:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
