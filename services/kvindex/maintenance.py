"""Keeping index and files together: re-sync from the storage tier, retention, capacity, orphans.

* ``replay``: the files are the truth. Every block file not in the index is
  added (stored = last access = its mtime); every index entry without a file
  is dropped, unless it was stored after the scan began (its event raced the
  scan). Runs when the index is empty/lost, on an event-id gap and on a
  "cleared" event.
* ``expire``: a block whose class's retention has passed since its last
  access (agent 3 days, chat 7 days by default) is dropped
  from the index, then its file is deleted.
* ``evict_to_capacity``: while the indexed bytes exceed the capacity, the
  least recently used blocks are dropped, then their files deleted.
* ``remove_orphan_ephemeral``: ephemeral block files older than a TTL (a
  decode that never came), and temporary files of block writes older than it
  (a writer killed mid-write), are deleted.

Index entries go first, files second: a reader that races the deletion
misses on the file and recomputes (a miss, never an error); a crash between
the two leaves a file that the next replay indexes again or expires.
File-system work runs on a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from deepinfer.kvindex.index import NewBlock, RedisIndex, Removed
from deepinfer.kvstore.format import block_path
from deepinfer.kvstore.scan import ephemeral_files, scan_blocks, temp_files
from deepinfer.telemetry import get_logger

log = get_logger(__name__)

_CHUNK = 500  # blocks per Redis script call


@dataclass
class ReplayResult:
    """scanned: block files found; added / dropped: index entries added / dropped."""

    scanned: int = 0
    added: int = 0
    dropped: int = 0


def _delete_files(root: str, removed: list[Removed]) -> int:
    n = 0
    for b in removed:
        try:
            block_path(root, b.fingerprint, b.retention_class, b.key).unlink()
            n += 1
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            log.warning("kv_file_delete_failed", key=b.key, error=str(e))
    return n


async def delete_files(root: str, removed: list[Removed]) -> int:
    """Delete the files of dropped blocks (on a thread); returns how many existed. Never raises OSError."""
    if not removed:
        return 0
    return await asyncio.to_thread(_delete_files, root, removed)


async def replay(index: RedisIndex, root: str, now: float, default_block_tokens: int,
                 fingerprint: str | None = None) -> ReplayResult:
    """Re-sync the index with the files of ``fingerprint`` (or of every fingerprint) under ``root``.

    ``now``: the index clock at the start of the scan; a file's time is
    ``min(mtime, now)``. Raises RedisError when Redis fails midway (the next
    replay finishes the job).
    """
    files = await asyncio.to_thread(lambda: list(scan_blocks(root, fingerprint)))
    result = ReplayResult(scanned=len(files))
    on_disk = set()
    batch: list[NewBlock] = []
    for f in files:
        on_disk.add((f.retention_class, f.key))
        batch.append(NewBlock(f.retention_class, f.key, f.fingerprint, f.nbytes,
                              f.num_tokens or default_block_tokens, min(f.mtime, now)))
        if len(batch) >= _CHUNK:
            result.added += await index.add_if_absent(batch)
            batch = []
    result.added += await index.add_if_absent(batch)

    stale = [(cls, h) async for cls, h, fp, stored in index.entries()
             if (fingerprint is None or fp == fingerprint) and (cls, h) not in on_disk and stored < now]
    for i in range(0, len(stale), _CHUNK):
        chunk = stale[i : i + _CHUNK]
        # NOTE: stored <= just below the scan start: an entry whose "stored" event raced the scan survives.
        dropped = await index.remove(chunk, field="stored", bounds=[now - 1e-6] * len(chunk))
        result.dropped += len(dropped)
    return result


async def expire(index: RedisIndex, root: str, retention_of, now: float) -> list[Removed]:
    """Drop and delete every block whose class's retention passed since its last access.

    ``retention_of(class) -> seconds``. Returns the dropped blocks.
    """
    out: list[Removed] = []
    for cls in await index.classes():
        cutoff = now - retention_of(cls)
        while True:
            rows = await index.expired(cls, cutoff, limit=_CHUNK)
            if not rows:
                break
            removed = await index.remove([(cls, h) for h, _ in rows], field="access", bounds=[cutoff] * len(rows))
            await delete_files(root, removed)
            out += removed
            if len(rows) < _CHUNK or not removed:
                break
    return out


async def evict_to_capacity(index: RedisIndex, root: str, capacity_bytes: int) -> list[Removed]:
    """Drop and delete least-recently-used blocks until the indexed bytes fit ``capacity_bytes`` (0 = no limit)."""
    out: list[Removed] = []
    if capacity_bytes <= 0:
        return out
    for _ in range(10_000):  # bounded: each round removes blocks or stops
        excess = await index.total_bytes() - capacity_bytes
        if excess <= 0:
            break
        victims, bounds = [], []
        for cls, h, access, size in await index.least_recent(limit=64):
            victims.append((cls, h))
            bounds.append(access)  # only if not touched since we looked
            excess -= size
            if excess <= 0:
                break
        if not victims:
            break
        removed = await index.remove(victims, field="access", bounds=bounds)
        await delete_files(root, removed)
        out += removed
    return out


def _remove_old_ephemeral(root: str, cutoff: float) -> int:
    n = 0
    for path, mtime in itertools.chain(ephemeral_files(root), temp_files(root)):
        if mtime <= cutoff:
            try:
                os.unlink(path)
                n += 1
            except OSError:
                pass
    return n


async def remove_orphan_ephemeral(root: str | Path, ttl_s: float, now: float) -> int:
    """Delete ephemeral block files, and temporary files of block writes, written ``ttl_s`` or more
    before ``now``; returns how many."""
    return await asyncio.to_thread(_remove_old_ephemeral, str(root), now - ttl_s)
