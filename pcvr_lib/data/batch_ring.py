"""Batches handed from the loader's worker processes to the consuming process through shared memory.

Through the DataLoader's queue alone, every tensor of a ~20 MB batch would be moved into a fresh
shared-memory segment by torch's pickler (a copy, a file descriptor sent over a socket, page faults on
both sides), which cost more than a second worker gained. Instead each worker fills a ring of
preallocated slots in one file on shared memory (/dev/shm where there is one), mapped once by the worker
and once by the consumer, and only a small descriptor goes through the queue: the ring, the slot, and
each tensor's dtype, shape and offset (the Batch with `SlotTensor`s where its tensors were). The worker's
converter converts straight into a free slot (`RingSender.take` is its arena source), so a converted batch
is sent without a copy; a batch made after conversion (augmented, row-selected, a cache hit) is copied into
a slot once. The consumer's batch is tensors over its mapping of the slot, no copy.

Lifetime (the rule a DataLoader user expects: a batch is valid for as long as anything refers to it):
a slot is busy from the moment the worker takes it until the last tensor over it is gone in the consumer.
Every tensor of a received batch, and every view of one, keeps the slot's array alive, and a
`weakref.finalize` on that array marks the slot free in the ring's header when it goes. When every slot
is busy (a consumer keeping many batches, e.g. `list(loader)`), the worker hands that batch over the
ordinary way, through torch's pickler (counted: `stats()["handoff"]["pickled"]`); it never waits for the
consumer, which may be waiting for it. A batch larger than the slots (the first one sized them) makes the
worker start a new ring with larger slots (`rings`).

One ring per worker and iteration, in that iteration's folder of the loader's shared store: descriptors of
an iteration stopped early are dropped unread, and their slots go with the ring. A ring is mapped where its
first descriptor arrives; the consumer removes the iteration's ring files when it is complete (and the
store removes an unfinished iteration's folder), and the memory goes when the last mapping does.

A worker may also lend a slot to another worker (`lend`): the batches of a row group are converted by the
one worker that decodes it (loader_pipeline), and a batch due to come out of another worker goes to that
worker as a descriptor of the converter's slot instead of a file of the shared store; that worker passes
the descriptor on as it is when no split filter or augmentation applies, and otherwise makes its own batch
from the slot and sends that through its own ring.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pcvr_lib.data.batch import Batch

# per worker: the DataLoader's prefetch (2), the consumer's current and previous batch, the batch being
# converted, and the batches lent to the other worker
SLOTS = 8
_ALIGN = 64  # every tensor starts on a cache line
_SPARE_PER_ROW = 64  # the slot's spare end: room for the small per-row tensors the converter allocates apart
_PAGE = 4096
_FREE, _BUSY = 0, 1


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class SlotTensor:
    """Where one tensor of a batch lies in its slot: byte offset, dtype name, shape."""

    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SlotBatch:
    """The descriptor a worker sends instead of a batch: `skeleton` is the Batch with SlotTensors."""

    ring: str  # file name of the ring, in the iteration's folder
    slots: int
    slot_bytes: int
    slot: int
    skeleton: Batch

    @property
    def batch_size(self) -> int:
        return int(self.skeleton.label.shape[0])


class _Ring:
    """One ring file: a header page with a state byte per slot, then `slots` slots of `slot_bytes`."""

    def __init__(self, path: Path, slots: int, slot_bytes: int, create: bool):
        self.path, self.slots, self.slot_bytes = path, slots, slot_bytes
        self.header = _round_up(slots, _PAGE)
        size = self.header + slots * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)  # MAP_SHARED: both processes see the same pages
        finally:
            os.close(fd)
        self.states = np.frombuffer(self.map, dtype=np.uint8, count=slots)

    def slot_array(self, slot: int) -> np.ndarray:
        """A new array over the slot, made from the mapping itself: every slice of it (and every tensor made
        from one) keeps this array alive, not some larger view (numpy points a view of a view at the first
        array, so a slice of a slice of the whole ring would keep only the ring alive)."""
        offset = self.header + slot * self.slot_bytes
        return np.frombuffer(self.map, dtype=np.uint8, count=self.slot_bytes, offset=offset)


def _slot_tensor(memory: np.ndarray, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(memory[offset : offset + nbytes]).view(dtype).view(shape)


def _layout(batch: Batch) -> tuple[dict[int, int], int]:
    """Each tensor's byte offset (keyed by id) when the batch is laid out in one buffer, and the bytes needed."""
    offsets, need = {}, 0
    for t in batch.tensors():
        offsets[id(t)] = need
        need += _round_up(t.numel() * t.element_size(), _ALIGN)
    return offsets, need


def _copy_into(memory: np.ndarray, batch: Batch, offsets: dict[int, int]) -> None:
    for t in batch.tensors():
        _slot_tensor(memory, offsets[id(t)], t.dtype, t.shape).copy_(t)


def _skeleton(batch: Batch, offset_of) -> Batch:
    """The batch with a SlotTensor (offset, dtype, shape) in place of each tensor."""
    return batch.map(lambda t: SlotTensor(offset_of(t), str(t.dtype).removeprefix("torch."), tuple(t.shape)))


def _batch_over(memory: np.ndarray, skeleton: Batch) -> Batch:
    """The batch a skeleton describes, its tensors over `memory` (no copy)."""
    return skeleton.map(lambda spot: _slot_tensor(memory, spot.offset, getattr(torch, spot.dtype), spot.shape),
                        leaf=SlotTensor)


class RingSender:
    """A worker's side for one iteration. The converter converts into the ring's free slots (`take`, the
    converter's arena source), so that `send(batch)` usually copies nothing: a batch whose tensors lie in
    one slot (the converter's arrays there; the few small ones it allocates apart are copied into the
    slot's spare end) is sent as that slot's descriptor. Any other batch (filtered, augmented, from the
    shared cache) is copied into a free slot first, and with none free it is sent pickled. A slot is free
    when no consumer holds it (its state byte) and nothing in this worker refers to it (its array's
    reference count). `directory` is the iteration's folder of the shared store; `batch_rows` the
    loader's batch size (a short first batch still sizes the slots for full ones)."""

    def __init__(self, directory: str | Path, worker: int, batch_rows: int, slots: int = SLOTS):
        self.directory, self.worker, self.batch_rows, self.slots = Path(directory), worker, batch_rows, slots
        self.ring: _Ring | None = None
        self.arrays: list[np.ndarray] = []  # one array per slot of the current ring, kept for the refcounts
        self.free_refs: list[int] = []
        self.counts = {"shared": 0, "copied": 0, "pickled": 0, "lent": 0, "rings": 0, "slot_bytes": 0}
        self.unavailable: str | None = None  # why there is no ring (too little shared memory): batches are pickled

    def _new_ring(self, need: int, rows: int) -> None:
        # room for full batches when the first one is short, and for the small tensors the converter makes apart
        slot_bytes = _round_up(max(need, need * self.batch_rows // max(rows, 1)) + _SPARE_PER_ROW * self.batch_rows,
                               _PAGE)
        path = self.directory / f"ring-{self.worker}-{self.counts['rings']}.bin"
        size = _round_up(self.slots, _PAGE) + self.slots * slot_bytes
        fs = os.statvfs(self.directory)
        free = fs.f_bavail * fs.f_frsize
        if free < size:  # a small /dev/shm (containers): writing a page there past its size is a SIGBUS
            self.unavailable = f"{self.directory}: {free >> 20} MiB free, a ring needs {size >> 20} MiB"
            # on stderr itself: a worker process's warnings filter may be anyone's (a test runner's, recording)
            print(f"warning: loader worker {self.worker}: no shared-memory ring ({self.unavailable}); its batches "
                  "are pickled instead, which is slower (make /dev/shm larger)", file=sys.stderr, flush=True)
            self.ring, self.arrays, self.free_refs = None, [], []
            return
        self.counts.update(rings=self.counts["rings"] + 1, slot_bytes=slot_bytes)
        self.ring = _Ring(path, self.slots, slot_bytes, create=True)
        self.arrays = [self.ring.slot_array(k) for k in range(self.slots)]
        self.free_refs = [sys.getrefcount(self.arrays[k]) for k in range(self.slots)]  # as _free_slot counts

    def _free_slot(self) -> int | None:
        """The lowest free slot: the slots used most recently are reused first, so the pages of the others
        are never touched (each first touch is a page fault)."""
        for k in range(self.ring.slots):
            if self.ring.states[k] == _FREE and sys.getrefcount(self.arrays[k]) == self.free_refs[k]:
                return k
        return None

    def take(self, nbytes: int, rows: int) -> np.ndarray | None:
        """The converter's arena source: a free slot's array (at least `nbytes`), or None (the converter then
        uses memory of its own and `send` copies)."""
        if self.ring is None and self.unavailable is None:
            self._new_ring(nbytes, rows)
        if self.ring is None or nbytes > self.ring.slot_bytes:
            return None
        k = self._free_slot()
        return self.arrays[k] if k is not None else None

    def _slot_of(self, batch: Batch) -> int | None:
        """The slot of the current ring holding the batch's first tensor, if one does."""
        if self.ring is None:
            return None
        first = batch.tensors()[0]
        base = self.arrays[0].ctypes.data
        k = (first.data_ptr() - base) // self.ring.slot_bytes
        if first.data_ptr() < base or k >= self.ring.slots:
            return None
        start, end = self.arrays[k].ctypes.data, self.arrays[k].ctypes.data + self.ring.slot_bytes
        inside = start <= first.data_ptr() and first.data_ptr() + first.numel() * first.element_size() <= end
        return int(k) if inside else None

    def _in_place(self, batch: Batch) -> SlotBatch | None:
        """The descriptor of a batch converted into a slot not yet sent, its tensors made apart copied into
        the slot's spare end; None when the batch is not (entirely) there."""
        k = self._slot_of(batch)
        if k is None or self.ring.states[k] != _FREE:
            return None
        memory = self.arrays[k]
        start, end = memory.ctypes.data, memory.ctypes.data + memory.size
        inside, outside, used = [], [], 0
        for t in batch.tensors():
            nbytes = t.numel() * t.element_size()
            if start <= t.data_ptr() and t.data_ptr() + nbytes <= end:
                if not t.is_contiguous():
                    return None
                inside.append(t)
                used = max(used, t.data_ptr() - start + nbytes)
            else:
                outside.append(t)
        offset, placed = _round_up(used, _ALIGN), {}
        for t in outside:
            nbytes = t.numel() * t.element_size()
            if offset + nbytes > memory.size:
                return None
            placed[id(t)] = offset
            offset = _round_up(offset + nbytes, _ALIGN)
        for t in outside:
            _slot_tensor(memory, placed[id(t)], t.dtype, t.shape).copy_(t)
        self.ring.states[k] = _BUSY
        return self._handle(batch, k, lambda t: placed[id(t)] if id(t) in placed else t.data_ptr() - start)

    def _copied(self, batch: Batch) -> SlotBatch | None:
        """The batch copied into a free slot (a new ring with larger slots when it does not fit); None when
        every slot is busy."""
        offsets, need = _layout(batch)
        if (self.ring is None or need > self.ring.slot_bytes) and self.unavailable is None:
            self._new_ring(need, batch.batch_size)
        k = self._free_slot() if self.ring is not None and need <= self.ring.slot_bytes else None
        if k is None:
            return None
        _copy_into(self.arrays[k], batch, offsets)
        self.ring.states[k] = _BUSY
        return self._handle(batch, k, lambda t: offsets[id(t)])

    def _handle(self, batch: Batch, slot: int, offset_of) -> SlotBatch:
        return SlotBatch(self.ring.path.name, self.ring.slots, self.ring.slot_bytes, slot, _skeleton(batch, offset_of))

    def _place(self, batch: Batch) -> SlotBatch | None:
        handle = self._in_place(batch)
        if handle is not None:
            return handle
        handle = self._copied(batch)
        self.counts["copied"] += handle is not None
        return handle

    def send(self, batch):
        """What the worker yields for the consumer: a descriptor (the batch's own slot, or a copy in a free
        one), a descriptor passed on as it is (a batch another worker lent), or the batch itself, pickled by
        the DataLoader, when every slot is busy."""
        handle = batch if isinstance(batch, SlotBatch) else self._place(batch)
        self.counts["shared" if handle is not None else "pickled"] += 1
        # pickled as a batch of its own memory (its tensors may lie in a slot, a private arena or a mapped file)
        return handle if handle is not None else batch.clone()

    def lend(self, batch: Batch) -> SlotBatch | None:
        """A descriptor for another worker (a batch converted here from a row group only this worker
        decodes), which passes it on or makes a batch of its own from it; None when every slot is busy."""
        handle = self._place(batch)
        self.counts["lent"] += handle is not None
        return handle

    def stats(self) -> dict:
        return dict(self.counts, slots=self.slots, unavailable=self.unavailable)


def _release(states: np.ndarray, slot: int) -> None:
    states[slot] = _FREE


class RingReceiver:
    """The consumer's side: `receive(item)` -> a Batch over the slot (or `item` itself, a pickled batch)."""

    def __init__(self):
        self.rings: dict[str, _Ring] = {}
        self.directory: Path | None = None

    def start(self, directory: str | Path) -> None:
        """A new iteration, whose rings are in `directory`: the previous iteration's rings are let go of
        (their batches still alive keep their mappings)."""
        self.rings = {}
        self.directory = Path(directory)

    def finish(self) -> None:
        """The iteration is complete (every worker is done, so every ring is mapped wherever it is used):
        remove the ring files; the memory goes when the last mapping does."""
        for path in self.directory.glob("ring-*.bin") if self.directory is not None else ():
            path.unlink(missing_ok=True)

    def receive(self, item):
        if not isinstance(item, SlotBatch):
            return item
        ring = self.rings.get(item.ring)
        if ring is None:
            ring = self.rings[item.ring] = _Ring(self.directory / item.ring, item.slots, item.slot_bytes, create=False)
        memory = ring.slot_array(item.slot)  # this batch's own array: the slot is busy while it lives
        weakref.finalize(memory, _release, ring.states, item.slot)
        return _batch_over(memory, item.skeleton)


def write_batch_file(path: str | Path, batch: Batch) -> None:
    """The batch in one file (on shared memory), laid out as in a ring slot: an 8-byte length, the pickled
    skeleton (a Batch of SlotTensors), then each tensor's bytes at its offset. One copy per tensor, where
    torch.save took ~10x longer for a 20 MB batch; `read_batch_file` maps it back without a copy."""
    offsets, need = _layout(batch)
    skeleton = pickle.dumps(_skeleton(batch, lambda t: offsets[id(t)]))
    data = _round_up(8 + len(skeleton), _ALIGN)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, data + max(need, 1))
        with mmap.mmap(fd, data + max(need, 1)) as mapped:
            mapped[:8] = struct.pack("<q", len(skeleton))
            mapped[8:8 + len(skeleton)] = skeleton
            memory = np.frombuffer(mapped, dtype=np.uint8, count=max(need, 1), offset=data)
            _copy_into(memory, batch, offsets)
            del memory  # the mapping cannot close while an array refers to it
    finally:
        os.close(fd)


def read_batch_file(path: str | Path) -> Batch:
    """A batch written by `write_batch_file`, its tensors over a private copy-on-write mapping of the file
    (writes stay in this process; valid after the file is unlinked; the memory goes with the last tensor)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    (length,) = struct.unpack("<q", mapped[:8])
    skeleton = pickle.loads(mapped[8:8 + length])
    data = _round_up(8 + length, _ALIGN)
    return _batch_over(np.frombuffer(mapped, dtype=np.uint8, count=len(mapped) - data, offset=data), skeleton)
