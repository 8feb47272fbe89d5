"""The storage tier from asyncio: reads on a thread pool, writes behind a bounded queue.

Lifecycle of a write-behind batch (``submit_puts``)::

    caller (event loop)            writer thread                    caller's loop
    -------------------            -------------                    -------------
    submit_puts(blocks) --copy--> [queue, bounded in bytes] --> put() each block --> on_done(results)
      returns True at once         full? -> dropped, counted         "written" | "exists" | "error"

Blocks are copied at submit time (unless ``copy=False``), so the caller may
reuse its KV memory at once. A block whose file exists already is not
rewritten (content-addressed blocks are immutable). A write that fails with
OSError (storage full, read-only, unmounted) is skipped and counted in
``stats.write_errors``; the first failure of an outage is logged, the rest
only counted, and nothing is raised into the caller. ``flush()`` waits for the
queue to empty (tests, shutdown).

Reads (``read_into``, ``read_prefix_into``, ``get``) run on ``io_threads``
threads; ``read_prefix_into`` splits its blocks into ``io_threads`` runs read
in parallel (file reads release the GIL; the XXH3 checksum runs at ~40 GB/s).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from deepinfer.kvstore.stats import StoreStats
from deepinfer.kvstore.store import BlockStore
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


@dataclass
class WriteResult:
    """Outcome of one write-behind block write.

    status: "written" (``nbytes`` payload bytes), "exists" (the file was there
    already; nothing written), "error" (OSError; ``error`` says which) or
    "dropped" (the queue was full; never attempted).
    """

    key: str
    retention_class: str
    status: str
    nbytes: int = 0
    error: str | None = None


OnDone = Callable[[list[WriteResult]], object]


@dataclass
class _Batch:
    blocks: list[tuple[str, torch.Tensor]]
    retention_class: str
    num_tokens: int | None
    skip_existing: bool
    on_done: OnDone | None
    loop: asyncio.AbstractEventLoop | None
    nbytes: int


class AsyncBlockStore:
    """Wraps a ``BlockStore`` for asyncio callers. ``stats`` is the wrapped store's.

    io_threads: threads for reads and awaited writes. max_pending_bytes /
    max_pending_batches: bounds of the write-behind queue (payload bytes held
    in copies, batches); a batch that would exceed either is dropped.
    """

    def __init__(self, store: BlockStore, io_threads: int = 2, max_pending_bytes: int = 256 << 20,
                 max_pending_batches: int = 1024):
        self.store = store
        self.io_threads = io_threads
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-io")
        self.max_pending_bytes = max_pending_bytes
        self.max_pending_batches = max_pending_batches
        self._queue: deque[_Batch] = deque()
        self._pending_bytes = 0
        self._busy = False  # the writer thread is working on a batch taken off the queue
        self._cond = threading.Condition()
        self._closed = False
        self._writer: threading.Thread | None = None
        self._error_logged = False
        self._tasks: set[asyncio.Task] = set()

    @property
    def stats(self) -> StoreStats:
        return self.store.stats

    @property
    def pending_bytes(self) -> int:
        """Payload bytes waiting in the write-behind queue (not yet written)."""
        return self._pending_bytes

    # --- reads (and awaited writes) on the pool -----------------------------------
    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def get(self, key: str, retention_class: str = "chat") -> torch.Tensor | None:
        """``BlockStore.get`` off the event loop."""
        return await self._run(self.store.get, key, retention_class)

    async def read_into(self, key: str, retention_class: str, out: torch.Tensor) -> bool:
        """``BlockStore.read_into`` off the event loop (False = miss; raises only for a non-contiguous out)."""
        return await self._run(self.store.read_into, key, retention_class, out)

    async def read_prefix_into(self, keys: Sequence[str], retention_class: str, out: torch.Tensor) -> int:
        """Read ``keys[i]`` into ``out[i]``, ``io_threads`` contiguous runs in parallel; returns the loaded prefix length.

        ``out``: contiguous ``[>= len(keys), *block_shape]``. Blocks after the
        first miss may have been read too, but only the prefix counts;
        ``out[n:]`` is unspecified.
        """
        if out.shape[0] < len(keys):
            raise ValueError(f"out holds {out.shape[0]} blocks, {len(keys)} keys given")
        if not out.is_contiguous():
            raise ValueError("read_prefix_into needs a contiguous tensor")
        runs = min(self.io_threads, len(keys))
        if runs == 0:
            return 0
        bounds = [(len(keys) * i // runs, len(keys) * (i + 1) // runs) for i in range(runs)]
        counts = await asyncio.gather(*(self._run(self.store.read_prefix_into, keys[a:b], retention_class, out[a:b])
                                        for a, b in bounds))
        n = 0
        for (a, b), c in zip(bounds, counts):
            n += c
            if c < b - a:
                break
        return n

    async def contains(self, key: str, retention_class: str = "chat") -> bool:
        return await self._run(self.store.contains, key, retention_class)

    async def delete(self, key: str, retention_class: str = "chat") -> bool:
        """Delete a block file; False if it was missing or could not be deleted (never raises OSError)."""
        try:
            return await self._run(self.store.delete, key, retention_class)
        except OSError as e:
            log.warning("kv_delete_failed", key=key, error=str(e))
            return False

    async def put(self, key: str, block: torch.Tensor, retention_class: str = "chat",
                  num_tokens: int | None = None) -> int:
        """Write now (awaited, on the pool); payload bytes written, 0 if the write failed (counted, not raised)."""
        return (await self._run(self._write_one, key, block, retention_class, num_tokens, False)).nbytes

    # --- write-behind ---------------------------------------------------------------
    def submit_put(self, key: str, block: torch.Tensor, retention_class: str = "chat", **kw) -> bool:
        """``submit_puts`` of one block."""
        return self.submit_puts([(key, block)], retention_class, **kw)

    def submit_puts(self, blocks: Sequence[tuple[str, torch.Tensor]], retention_class: str = "chat", *,
                    num_tokens: int | None = None, copy: bool = True, skip_existing: bool = True,
                    on_done: OnDone | None = None) -> bool:
        """Queue ``(key, block)`` writes and return at once: True if queued, False if dropped.

        copy: snapshot the blocks now (False only if the caller never changes
        them again). num_tokens: tokens per block, recorded in each header.
        skip_existing: do not rewrite a block whose file exists. on_done:
        called once with one ``WriteResult`` per block, in order -- on the
        event loop that called this (a coroutine it returns is run as a task),
        or on the writer thread when called outside a loop. A dropped batch
        calls it at once with status "dropped". Never raises for storage
        errors; raises ValueError for an unsafe class name.
        """
        self.store.path("00", retention_class)  # validates the class name
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        nbytes = sum(b.numel() * b.element_size() for _, b in blocks)
        with self._cond:
            # NOTE: one batch larger than the bound is still taken when nothing else is queued.
            full = (self._closed or len(self._queue) >= self.max_pending_batches
                    or (bool(self._queue) and self._pending_bytes + nbytes > self.max_pending_bytes))
            if not full:
                snap = [(k, self._snapshot(b) if copy else b) for k, b in blocks]
                self._queue.append(_Batch(snap, retention_class, num_tokens, skip_existing, on_done, loop, nbytes))
                self._pending_bytes += nbytes
                self._ensure_writer()
                self._cond.notify_all()
        if full:
            self.stats.add(writes_dropped=len(blocks))
            log.debug("kv_write_dropped", blocks=len(blocks), pending_bytes=self._pending_bytes)
            if on_done is not None:
                self._call_done(on_done, loop, [WriteResult(k, retention_class, "dropped") for k, _ in blocks])
            return False
        return True

    @staticmethod
    def _snapshot(block: torch.Tensor) -> torch.Tensor:
        block = block.detach()
        if block.device.type != "cpu":
            return block.to("cpu")
        return block.clone(memory_format=torch.contiguous_format)

    def _ensure_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="kvstore-writer", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and empty
                batch = self._queue.popleft()
                self._busy = True
            try:
                results = [self._write_one(k, b, batch.retention_class, batch.num_tokens, batch.skip_existing)
                           for k, b in batch.blocks]
                if batch.on_done is not None:
                    self._call_done(batch.on_done, batch.loop, results)
            except Exception:  # a bug in a callback must not kill the writer
                log.exception("kv_write_behind_failed")
            finally:
                with self._cond:
                    self._pending_bytes -= batch.nbytes
                    self._busy = False
                    self._cond.notify_all()

    def _write_one(self, key: str, block: torch.Tensor, retention_class: str, num_tokens: int | None,
                   skip_existing: bool) -> WriteResult:
        try:
            if skip_existing and self.store.contains(key, retention_class):
                self.stats.add(writes_skipped=1)
                return WriteResult(key, retention_class, "exists")
            n = self.store.put(key, block, retention_class, num_tokens)
        except OSError as e:  # counted by BlockStore.put (or a failed stat)
            if not self._error_logged:
                self._error_logged = True
                log.warning("kv_write_failed", root=str(self.store.root), error=str(e),
                            note="further write errors are only counted until a write succeeds")
            return WriteResult(key, retention_class, "error", error=str(e))
        self._error_logged = False
        return WriteResult(key, retention_class, "written", n)

    def _call_done(self, on_done: OnDone, loop: asyncio.AbstractEventLoop | None,
                   results: list[WriteResult]) -> None:
        if loop is None:
            out = on_done(results)
            if inspect.iscoroutine(out):  # no loop to run it on
                log.warning("kv_on_done_coroutine_without_loop")
                out.close()
            return

        def run():
            try:
                out = on_done(results)
                if inspect.isawaitable(out):
                    task = asyncio.ensure_future(out)
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            except Exception:
                log.exception("kv_on_done_failed")

        try:
            if loop.is_closed():
                return
            if _running_loop() is loop:  # already on the loop's thread (a dropped batch)
                run()
            else:
                loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every queued write is done (and its on_done scheduled). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    async def aflush(self, timeout: float | None = None) -> bool:
        """``flush`` from the event loop (waits on a thread, not the loop)."""
        ok = await asyncio.to_thread(self.flush, timeout)
        await asyncio.sleep(0)  # let on_done callbacks scheduled by the writer run
        return ok

    def close(self, timeout: float | None = 10.0) -> None:
        """Write what is queued (up to ``timeout`` s), stop the writer, shut the pool down. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout)
        self.pool.shutdown(wait=False)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
