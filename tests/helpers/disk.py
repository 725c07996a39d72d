"""A disk that fills, at the one function that opens a spill file (``recording.spill._open``)."""
from __future__ import annotations

import errno
import os
from typing import Any


class FullFile:
    """A file on a disk with ``room`` bytes left (0: full): a write past it raises ENOSPC, as
    write(2) does; everything else is the real file's."""

    def __init__(self, f: Any, room: int = 0) -> None:
        self.f, self.room = f, room

    def write(self, b: Any) -> int:
        n = len(memoryview(b).cast("B"))
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return int(self.f.write(b))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)
