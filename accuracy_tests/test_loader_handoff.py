"""The loader's workers hand batches over through shared-memory slots (pcvr_lib/data/batch_ring.py): the
batches are bit for bit those of the in-process loader (last short batch, shuffling, steps included) and
are converted straight into the slots, a slot is never reused while anything still refers to a batch
over it, and a dead worker is an error, not a hang."""

from __future__ import annotations

import contextlib
import os
import signal

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from pcvr_lib.data import loader_pipeline
from pcvr_lib.data.batch_ring import SLOTS
from pcvr_lib.data.generate import generate_table
from pcvr_lib.data.loader import LoaderError, PcvrLoader
from pcvr_lib.schema import load_schema

ROWS, GROUP, BATCH = 400, 100, 64  # 4 row groups of 2 batches: 64 rows and a short one of 36


@pytest.fixture(scope="module")
def schema(repo_root):
    return load_schema(repo_root / "fixtures" / "sample_1000_raw.schema.json", "seq_a:8,seq_b:8,seq_c:16,seq_d:16")


@pytest.fixture(scope="module")
def dataset(schema, tmp_path_factory):
    table = generate_table(schema, ROWS, seed=3)
    for domain in schema.domains:  # short event lists keep the test fast
        for feat in domain.features:
            i = table.schema.get_field_index(feat.column)
            table = table.set_column(i, feat.column, pc.list_slice(table.column(i), 0, 24))
    path = tmp_path_factory.mktemp("handoff") / "demo.parquet"
    pq.write_table(table, path, row_group_size=GROUP)
    return path


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that equal means bit for bit (a float NaN or -0.0 included)."""
    return t.contiguous().view(torch.uint8)


def assert_identical(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))


def _snapshot(batches):
    return [b.clone() for b in batches]


@contextlib.contextmanager
def deadline(seconds: int, what: str):
    """Fail (instead of hanging the suite) when the block takes longer than `seconds`."""
    def expired(*_):
        raise AssertionError(f"{what} took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("options", [
    dict(passes=2, shuffle=True, seed=5),
    dict(mode="steps", steps=11, seed=9),
    dict(preset="augment", passes=1, shuffle=True, seed=2),
    dict(preset="opt", passes=2, shuffle=True, seed=1, cache_capacity=3),
], ids=["sweep-shuffled", "steps", "augment", "opt-cache"])
def test_workers_give_bit_identical_batches(options, schema, dataset):
    """0, 1 and 2 workers: the same batches in the same order, bit for bit, the row groups' short last
    batches included; consumed one at a time, every batch comes through a slot (none pickled)."""
    local = _snapshot(PcvrLoader(dataset, schema, batch_size=BATCH, **options))
    assert any(b.batch_size < BATCH for b in local) or options.get("preset") == "augment"
    for workers in (1, 2):
        loader = PcvrLoader(dataset, schema, batch_size=BATCH, num_workers=workers, **options)
        count = 0
        for reference, batch in zip(local, loader, strict=True):
            assert_identical(reference, batch)
            count += 1
        assert count == len(local)
        stats = loader.stats()
        handoff = stats["handoff"]
        assert handoff["shared"] == count and handoff["pickled"] == 0, handoff
        # batches made after conversion (augmented views, cache hits read from the shared store) are copied
        # into a slot; the others were converted into one (unless every slot was busy then: timing)
        made_after = count if "augment" in options.get("preset", "") else stats["cache"]["hits"]
        assert handoff["copied"] >= made_after, handoff
        # each worker decodes with its share of the cores, never fewer than one thread
        cores = len(os.sched_getaffinity(0))
        assert stats["arrow_threads"] == [max(1, cores // workers)] * workers


def test_worker_arrow_threads_share_the_cores_out(monkeypatch):
    """W workers get cores // W Arrow decoder threads each, and one each when there are more workers than
    cores."""
    for cores, workers, expected in ((2, 2, 1), (4, 2, 2), (16, 3, 5), (2, 4, 1), (1, 1, 1), (8, 1, 8)):
        monkeypatch.setattr(loader_pipeline.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert loader_pipeline.worker_arrow_threads(workers) == expected


def test_held_batches_are_never_overwritten(schema, dataset):
    """list(loader) keeps every batch: each slot is used once, the rest are pickled rather than written
    over a batch still held, and at the end every batch is still the in-process loader's."""
    # unpinned: on a CUDA machine the loader pins each batch as it comes out (a copy), which frees its slot
    options = dict(batch_size=BATCH, passes=2, shuffle=True, seed=4, pin_memory=False)
    local = _snapshot(PcvrLoader(dataset, schema, **options))
    assert len(local) > SLOTS
    loader = PcvrLoader(dataset, schema, num_workers=1, **options)
    held = list(loader)
    for reference, batch in zip(local, held, strict=True):
        assert_identical(reference, batch)
    handoff = loader.stats()["handoff"]
    # each slot sent once: the first ring's 8, and a ring of larger slots the worker starts when a later batch
    # does not fit the first ring's (ragged sequences; its first batch sizes that one) adds at most 8 more
    assert SLOTS <= handoff["shared"] <= SLOTS * handoff["rings"], handoff
    assert handoff["shared"] + handoff["pickled"] == len(local), handoff


def test_a_view_keeps_its_slot_and_a_dropped_batch_frees_it(schema, dataset):
    """A view of one field outlives its batch and keeps its values while later batches stream through the
    same worker's slots; once nothing refers to a batch, its slot is used again (one ring, no pickling)."""
    options = dict(batch_size=BATCH, passes=3, shuffle=True, seed=6, pin_memory=False)  # the slots' own memory
    local = _snapshot(PcvrLoader(dataset, schema, **options))
    loader = PcvrLoader(dataset, schema, num_workers=1, **options)
    kept = None
    for i, batch in enumerate(loader):
        if i == 0:
            kept = batch.sequences["seq_c"].values[1:3]  # a view into the slot of batch 0
            expected = local[0].sequences["seq_c"].values[1:3].clone()
    assert torch.equal(kept, expected)
    handoff = loader.stats()["handoff"]
    assert handoff["pickled"] == 0 and handoff["rings"] == 1 and handoff["shared"] == len(local) > 2 * SLOTS


def test_a_second_iteration_and_an_early_stop(schema, dataset):
    """Persistent workers: an iteration stopped early leaves nothing behind that changes the next one."""
    options = dict(batch_size=BATCH, passes=2, shuffle=True, seed=8)
    local = _snapshot(PcvrLoader(dataset, schema, **options))
    loader = PcvrLoader(dataset, schema, num_workers=2, **options)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    # a worker may be waiting for a batch the other was never asked to make: it must give up, not time out
    with deadline(60, "the iteration after an early stop"):
        again = _snapshot(loader)
    assert len(again) == len(local)
    for a, b in zip(local, again, strict=True):
        assert_identical(a, b)


def test_close_stops_the_workers_and_frees_their_memory(schema, dataset):
    """`close()` (or leaving a `with` block) stops the worker processes and removes the shared memory at
    once, even after an iteration stopped early; the stats stay, and a later iteration starts new workers."""
    from pathlib import Path

    options = dict(batch_size=BATCH, passes=1, seed=4)
    local = _snapshot(PcvrLoader(dataset, schema, **options))
    with PcvrLoader(dataset, schema, num_workers=2, **options) as loader:
        got = _snapshot(loader)
        pids = [w.pid for w in loader._dataloader._iterator._workers]
        store = Path(loader._store_dir)
        assert all(_alive(pid) for pid in pids) and any(store.rglob("*"))  # persistent between iterations
    assert not any(_alive(pid) for pid in pids) and not store.exists()
    assert loader.stats()["rows"] == ROWS
    for i, _ in enumerate(loader):  # new workers; then closed in the middle of an iteration
        if i == 1:
            break
    loader.close()
    loader.close()  # twice is harmless
    again = _snapshot(loader)
    loader.close()
    for a, b in zip(local, got, strict=True):
        assert_identical(a, b)
    assert len(again) == len(local)
    for a, b in zip(local, again, strict=True):
        assert_identical(a, b)


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our exited child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_batch_file_maps_back_bit_for_bit_after_its_file_is_gone(schema, dataset, tmp_path):
    """The shared cache's batch files (batch_ring.write_batch_file / read_batch_file): a converted batch, its
    tensors views of one buffer in several dtypes, and a non-contiguous one, come back bit for bit, and stay
    valid after the file is unlinked (as a reader does); an existing file is never written over."""
    from pcvr_lib.data.batch_ring import read_batch_file, write_batch_file

    batch = next(iter(PcvrLoader(dataset, schema, batch_size=BATCH, passes=1)))
    batch.label = torch.arange(2 * BATCH, dtype=torch.float32)[::2]  # a strided view
    path = tmp_path / "one.batch"
    write_batch_file(path, batch)
    back = read_batch_file(path)
    path.unlink()
    assert_identical(batch, back)
    back.label.add_(1)  # a private mapping: writable, and nothing else sees it
    assert torch.equal(back.label, batch.label + 1)
    with pytest.raises(FileExistsError):
        write_batch_file(tmp_path / "two.batch", batch) or write_batch_file(tmp_path / "two.batch", batch)


def test_a_dead_worker_is_an_error_not_a_hang(schema, dataset, monkeypatch):
    """A worker killed mid-iteration (as by the OOM killer): the iteration raises a LoaderError naming the
    file and saying that a worker died, within the DataLoader's watchdog period, instead of waiting."""
    real = loader_pipeline.Pipeline._one
    calls = {"n": 0}

    def dies_on_the_third_batch(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(loader_pipeline.Pipeline, "_one", dies_on_the_third_batch)
    loader = PcvrLoader(dataset, schema, batch_size=BATCH, passes=2, num_workers=1)
    served = 0
    with deadline(120, "the iteration with a dead worker"), pytest.raises(
            LoaderError, match=r"demo\.parquet: a loader worker process died \(DataLoader worker \(pid"):
        for _ in loader:
            served += 1
    assert served <= 2  # what the worker made before it died (its last batches may die with it)


def test_a_converted_batch_is_sent_from_its_slot_and_a_made_one_is_copied(schema, dataset, tmp_path):
    """In one process: the converter converts into the sender's slot, so the batch is sent without a copy;
    a batch made from it (a row selection) is copied into another slot; the receiver rebuilds both bit for
    bit, and the slots are busy until the received batches are gone."""
    from pcvr_lib.data.batch_ring import RingReceiver, RingSender, SlotBatch
    from pcvr_lib.data.convert import Converter

    table = pq.ParquetFile(dataset).read_row_group(0, columns=schema.converter_columns).slice(0, BATCH)
    sender = RingSender(tmp_path, worker=0, batch_rows=BATCH, slots=3)
    converter = Converter(schema, arena_source=sender)
    expected = Converter(schema)(table)
    sent = sender.send(converter(table))
    chosen = torch.tensor([5, 1, 9])
    made = sender.send(converter(table).select(chosen))
    assert isinstance(sent, SlotBatch) and isinstance(made, SlotBatch) and sent.slot != made.slot
    assert sender.stats()["copied"] == 1 and sender.stats()["shared"] == 2
    receiver = RingReceiver()
    receiver.start(tmp_path)
    first, second = receiver.receive(sent), receiver.receive(made)
    assert_identical(first, expected)
    assert_identical(second, expected.select(chosen))
    states = sender.ring.states
    assert states[sent.slot] == 1 and states[made.slot] == 1
    del first
    assert states[sent.slot] == 0 and states[made.slot] == 1  # the other one is still held
    del second
    assert states[made.slot] == 0


def test_too_little_shared_memory_pickles_the_batches_and_says_so(schema, dataset, monkeypatch, capfd):
    """Where /dev/shm is too small for a ring (a container's 64 MB), writing past it would kill the worker
    (SIGBUS): the worker makes no ring, pickles its batches (the same batches) and warns."""
    import pcvr_lib.data.batch_ring as batch_ring

    real = os.statvfs

    class Tiny:
        def __init__(self, path):
            stat = real(path)
            self.f_frsize, self.f_bavail = stat.f_frsize, 1

    monkeypatch.setattr(batch_ring.os, "statvfs", Tiny)
    options = dict(batch_size=BATCH, passes=1, shuffle=True, seed=3)
    local = _snapshot(PcvrLoader(dataset, schema, **options))
    loader = PcvrLoader(dataset, schema, num_workers=1, **options)
    for reference, batch in zip(local, loader, strict=True):
        assert_identical(reference, batch)
    handoff = loader.stats()["handoff"]
    assert handoff["pickled"] == len(local) and handoff["shared"] == 0 and handoff["rings"] == 0
    assert "MiB free, a ring needs" in handoff["ring_unavailable"][0]
    assert "no shared-memory ring" in capfd.readouterr().err
