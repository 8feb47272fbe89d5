"""Counters of one process's storage-tier traffic (for metrics and tests).

Thread-safe: block reads and writes run on I/O threads. Every field is a
monotonically increasing count since the store was created.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field


@dataclass
class StoreStats:
    """reads: block read attempts (get / read_into), = hits + misses.
    hits / misses: reads that returned a verified block / did not (missing,
    truncated, corrupt, other format, other fingerprint, other shape or dtype).
    corrupt: misses whose file existed but failed verification (a subset of misses).
    bytes_read / bytes_written: payload bytes of verified reads / completed writes.
    writes: completed block writes. write_errors: writes that failed with
    OSError (storage full, read-only, gone). writes_skipped: write-behind
    writes not done because the block file already existed. writes_dropped:
    write-behind writes dropped because the queue was full.
    """

    reads: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    writes_skipped: int = 0
    writes_dropped: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add to counters by name, atomically (``stats.add(reads=1, hits=1)``)."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of every counter."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
