"""Storage tracking by weak reference: the ``tensors`` table and alloc/free events.

Storages, not tensors: a tensor that autograd saves as an output
is a different TensorImpl whose Python object dies while its memory lives. The
``UntypedStorage`` Python object, in contrast, is preserved by torch as long as
the C++ storage lives, so ``weakref.ref(storage, callback)`` fires exactly when
the memory is released. One weak reference per storage first seen, keyed by
its data pointer; the callback records ``free_seq`` and drops the entry, so a
reused address is a new storage. Holding these weak references keeps nothing
alive. Zero-byte and meta storages (data pointer 0) and wrapper subclasses
(which raise on storage access) get storage id -1: unknown.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

#: ``fake.on`` is true on a thread while ``tensorscope.predict`` runs a step under FakeTensorMode: the
#: trackers made then key FakeTensors' storages (no memory, data pointer 0) by their StorageImpl;
#: ``fake.real`` maps the StorageImpl of a real tensor's fake copy (a parameter's) to the real data pointer
fake = threading.local()


def fake_key(storage) -> int:
    """A FakeTensor storage's key: the real storage's data pointer when it is the fake copy of one,
    else its StorageImpl's address, negated (never a data pointer); 0 (unknown, as a real one) for an
    empty storage."""
    if storage.nbytes() == 0:
        return 0
    cdata = int(storage._cdata)
    real = getattr(fake, "real", None)
    if real:
        ptr = real.get(cdata)
        if ptr is not None:
            return int(ptr)
    return -cdata


def is_fake(t) -> bool:
    """A FakeTensor (``torch._subclasses.fake_tensor``, not imported here: only under predict)."""
    return type(t).__name__ == "FakeTensor"


@dataclass(frozen=True)
class LiveStorage:
    """A storage the trace created that is alive at its end (for the leak finder)."""

    storage_id: int
    ref: Any                 # weakref.ref to the torch.UntypedStorage; call it, may return None
    data_ptr: int
    nbytes: int
    device: str
    dtype: str
    shape: tuple[int, ...]
    alloc_seq: Optional[int]
    alloc_op: Optional[str]
    cell: Optional[int]
    source_file: Optional[str]
    source_line: Optional[int]


def _no_seq() -> int:
    return -1


class StorageTracker:
    """Assigns storage ids by data pointer and watches each storage's death.

    Only live storages are held here (``live``: id -> (weakref, meta, nbytes, alloc_seq, module,
    call, data pointer)); a freed one's record goes to the recorder's ``StorageRows`` buffer
    (``recording/storage_rows.py``), which spills with the op chunks. ``seal()`` hands the live ones
    over when the tables are built; frees after that only forget them."""

    def __init__(self, rec, seq_fn: Callable[[], int]):
        self.rec = rec
        self.rows = rec.tensors
        self.rows.live_source = self.seal
        self._seq = seq_fn
        self.by_ptr: dict[int, int] = {}          # live data_ptr -> storage id
        self.live: dict[int, tuple[Any, int, int, int, int, int, int]] = {}
        self.n = 0                                # storages seen (the next id)
        self.devices: list[str] = []
        self.closed = False
        self.sealed = False
        self.fake_keys = bool(getattr(fake, "on", False))

    def _freed(self, sid: int):
        # Runs from the weakref callback, at an arbitrary point: keep it tiny.
        if self.closed:
            return
        r = self.live.pop(sid, None)
        if r is None:
            return
        _ref, meta, nbytes, alloc, module, call, ptr = r
        if not self.sealed:
            self.rows.buffer.extend((meta, nbytes, alloc, self._seq(), module, call, ptr, sid))
        if self.by_ptr.get(ptr) == sid:
            del self.by_ptr[ptr]

    def storage_id(self, storage, meta_id: int, alloc: bool, module_id: int, call_id: int,
                   ptr: Optional[int] = None) -> int:
        """Id of ``storage`` (an UntypedStorage); registers it when first seen.

        ``alloc`` says whether it appeared as an op output (created by the trace)
        rather than as an input that existed before; ``ptr``: its key when the caller has it.
        """
        if ptr is None:
            ptr = storage.data_ptr()
        if ptr == 0:
            return -1
        sid = self.by_ptr.get(ptr)
        if sid is not None:
            return sid
        sid = self.n
        try:
            # mypy cannot type a lambda whose argument is bound by a default
            ref = weakref.ref(storage, lambda _r, sid=sid: self._freed(sid))  # type: ignore[misc]
        except TypeError:
            return -1
        self.n += 1
        self.by_ptr[ptr] = sid
        self.live[sid] = (ref, meta_id, storage.nbytes(), self._seq() if alloc else -1, module_id, call_id, ptr)
        return sid

    def seal(self) -> list[tuple[int, ...]]:
        """The records of the storages alive now (``free_seq`` -1), once: from here on a free only
        forgets its storage (the tables are being built from the records)."""
        if self.sealed:
            return []
        self.sealed = True
        return [(meta, nbytes, alloc, -1, module, call, ptr, sid)
                for sid, (_ref, meta, nbytes, alloc, module, call, ptr) in list(self.live.items())]

    def live_created(self) -> list[tuple[int, Any]]:
        """(storage id, weakref) of storages the trace created that are still alive."""
        out = []
        for sid, r in list(self.live.items()):
            ref = r[0]
            if r[3] >= 0 and ref() is not None:
                out.append((sid, ref))
        return out

    def close(self):
        """Stop watching: the callbacks become no-ops and the weak refs are dropped."""
        self.closed = True
        self.live.clear()
        self.by_ptr.clear()
        self._seq = _no_seq   # the context's bound method: the context holds this tracker
