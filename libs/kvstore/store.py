"""Block files on a (possibly shared) POSIX directory: the synchronous store.

Layout and file format: ``deepinfer.kvstore.format`` (one file per block,
``<root>/<model fingerprint>/<retention class>/<key[:2]>/<key>.kvb``, a header
with magic, format version, fingerprint, key, dtype, shape, byte count and
XXH3-64 checksum, then the raw tensor bytes).

Writes go to a temporary name in the same directory and are renamed into
place (atomic on POSIX), so a reader sees a whole block or none. No fsync: a
block torn by a machine crash fails its checksum and is a miss. Readers verify the
fingerprint, key, length and checksum; a missing, truncated, corrupt or foreign
block is a miss (``None`` / ``False``), never an exception. A corrupt file
(damaged, not merely foreign) is deleted when ``drop_corrupt`` is set, so the
next writer replaces it. Any POSIX shared file system (3FS FUSE, NFS, CephFS)
makes the tier shared across machines.

Every method here blocks on file I/O: call them from I/O threads
(``deepinfer.kvstore.async_store.AsyncBlockStore`` does), not the event loop.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path
from typing import Sequence

import torch
import xxhash

from deepinfer.kvstore.format import (
    EPHEMERAL,
    BadBlock,
    SUFFIX,
    BlockHeader,
    block_path,
    check_checksum,
    check_length,
    check_name,
    encode_header,
    parse_header,
    read_payload,
)
from deepinfer.kvstore.stats import StoreStats

__all__ = ["BlockStore", "EPHEMERAL", "ephemeral_key"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8,
)}


def ephemeral_key(request_id: str, index: int, part: str = "") -> str:
    """Key of a request's block ``index`` handed off without a prefix hash (the partial last
    one, one computed after a bounded replay) or, with ``part`` "w", of its window layers'
    part (hybrid models); not content-addressed, deleted after use. ``part``: [a-z]*."""
    if not part.isascii() or (part and not part.isalpha()):
        raise ValueError(f"bad ephemeral part {part!r}")
    safe = "".join(c if (c.isascii() and c.isalnum()) or c in "-_" else "_" for c in request_id)
    # NOTE: led by 2 hex digits of the request id's hash, as block files are sharded by a key's first
    # two characters: every host's handoffs spread over 256 directories instead of one "ep/"
    return f"{xxhash.xxh3_64_hexdigest(request_id.encode())[:2]}{_EPH}{safe}-{part}{index}"


_EPH = "eph-"


def is_ephemeral(key: str) -> bool:
    """Whether ``key`` is an ``ephemeral_key`` (not a block's prefix hash)."""
    return key[2:2 + len(_EPH)] == _EPH


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable memoryview of a contiguous CPU tensor's bytes (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported block dtype {dtype}")
    return name


TIER_ID_FILE = ".tier-id"
_SUSPECT: dict[str, set[tuple[str, str]]] = {}  # ``BlockStore._suspect`` of each tier directory


def tier_id(root: str | Path) -> str:
    """The identity of the storage tier at ``root``: a random id in ``<root>/.tier-id``, written by
    the first process that looks (a hard link of a whole file, which fails if another process got
    there first, so concurrent first looks agree). Every worker reports it, so one started on
    another tier (a forgotten ``DEEPINFER_KV_ROOT`` gives a private local one) is seen and left out
    of routing. Raises OSError when the root is unusable."""
    path = Path(root) / TIER_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TIER_ID_FILE}.{uuid.uuid4().hex}")
    tmp.write_text(uuid.uuid4().hex)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links: a rename (first looks at once may differ once)
        if not path.exists():
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


class BlockStore:
    """The storage tier for one model fingerprint under ``root``.

    ``stats`` counts reads, hits, misses and bytes (``StoreStats``).

    A block that fails verification as damaged is a miss, and is not deleted: on a shared file
    system whose views are only eventually consistent, the reader may have seen a stale or partial
    version of a file another host has since replaced with a valid one, and deleting by path would
    remove that. The key is remembered as suspect in this process instead: ``contains`` then says
    it is absent, so the process's next writer of the block replaces it (an atomic rename of a whole, valid file,
    harmless whatever another host wrote meanwhile), and the kvindex, told by a "removed" event,
    checks the file again and deletes it if it is still damaged (``drop_corrupt``: a store that
    deletes such files itself, the kvindex's).
    """

    def __init__(self, root: str | Path, fingerprint: str, drop_corrupt: bool = False):
        self.root = Path(root)
        self.fingerprint = check_name(fingerprint, "fingerprint")
        self.base = self.root / fingerprint
        self._base = str(self.base)
        self.drop_corrupt = drop_corrupt
        self.stats = StoreStats()
        # (class, key) read as damaged in this process, not rewritten yet: one set per tier and
        # fingerprint, shared by the process's stores (a vLLM connector reads with one, saves with another)
        self._suspect = _SUSPECT.setdefault(self._base, set())
        self._tier_id: str | None = None

    @property
    def tier_id(self) -> str:
        """The identity of this storage tier (``tier_id(root)``), "" when the root is unusable."""
        if self._tier_id is None:
            try:
                self._tier_id = tier_id(self.root)
            except OSError:
                return ""
        return self._tier_id

    def path(self, key: str, retention_class: str) -> Path:
        """The block's file path. Raises ValueError when key or class is not [A-Za-z0-9_-]+."""
        return block_path(self.root, self.fingerprint, retention_class, key)

    def _fspath(self, key: str, retention_class: str) -> str:
        """``path`` as a string, without pathlib (reads are hot: ~10 us saved per block)."""
        check_name(retention_class, "retention class")
        check_name(key, "block key")
        return f"{self._base}/{retention_class}/{key[:2]}/{key}{SUFFIX}"

    # --- writing -------------------------------------------------------------
    def put(self, key: str, block: torch.Tensor, retention_class: str = "chat",
            num_tokens: int | None = None) -> int:
        """Write ``block`` (any shape and device; a dtype of ``_DTYPES``) under ``key``, atomically.

        ``num_tokens``: tokens the block holds, recorded in the header (the
        kvindex counts hit rates in tokens). Returns the payload bytes written.
        Raises OSError when the root is full, read-only or gone (counted in
        ``stats.write_errors``; no temporary file is left), ValueError for an
        unsafe key/class or an unsupported dtype.
        """
        path = self.path(key, retention_class)
        dtype = _dtype_name(block.dtype)
        block = block.detach()
        if block.device.type != "cpu":
            block = block.cpu()
        block = block.contiguous()
        payload = _byte_view(block)
        header = encode_header(BlockHeader(
            fingerprint=self.fingerprint, key=key, dtype=dtype, shape=list(block.shape),
            nbytes=len(payload), xxh3=xxhash.xxh3_64_intdigest(payload), num_tokens=num_tokens))
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
            self._suspect.discard((retention_class, key))
        except OSError:
            self.stats.add(write_errors=1)
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            raise
        self.stats.add(writes=1, bytes_written=len(payload))
        return len(payload)

    # --- reading -------------------------------------------------------------
    def get(self, key: str, retention_class: str = "chat") -> torch.Tensor | None:
        """Read a block into a new CPU tensor; None when missing, truncated, corrupt or foreign."""
        return self._read(key, retention_class, None)

    def read_into(self, key: str, retention_class: str, out: torch.Tensor) -> bool:
        """Read a block's payload straight into ``out`` (file -> ``out``'s memory, no staging copy on CPU).

        ``out`` must be contiguous and have the block's exact shape and dtype;
        on another device the block goes through one CPU staging tensor.
        Returns True when ``out`` now holds the verified block; False for a
        miss (missing, truncated, corrupt, other fingerprint / format, other
        shape or dtype) -- then ``out``'s contents are unspecified (possibly
        partly overwritten). Raises ValueError only for a non-contiguous
        ``out`` or an unsafe key/class (caller bugs), never for the file.
        """
        if not out.is_contiguous():
            raise ValueError("read_into needs a contiguous tensor")
        staging = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
        got = self._read(key, retention_class, staging)
        if got is None:
            return False
        if staging is not out:
            out.copy_(staging)
        return True

    def read_prefix_into(self, keys: Sequence[str], retention_class: str, out: torch.Tensor) -> int:
        """Read ``keys[i]`` into ``out[i]`` in order, stopping at the first miss.

        ``out``: contiguous ``[>= len(keys), *block_shape]``. Returns how many
        leading blocks were loaded (0..len(keys)); ``out[n:]`` is unspecified.
        """
        if out.shape[0] < len(keys):
            raise ValueError(f"out holds {out.shape[0]} blocks, {len(keys)} keys given")
        for i, key in enumerate(keys):
            if not self.read_into(key, retention_class, out[i]):
                return i
        return len(keys)

    def _read(self, key: str, retention_class: str, out: torch.Tensor | None) -> torch.Tensor | None:
        """Verified read into ``out`` (or a new tensor); None on any miss. Counts in ``stats``."""
        path = self._fspath(key, retention_class)
        try:
            f = open(path, "rb", buffering=0)
        except OSError:
            self.stats.add(reads=1, misses=1)
            return None
        try:
            with f:
                dst = self._read_payload(f, key, out)
        except BadBlock as e:
            self.stats.add(reads=1, misses=1, corrupt=int(e.corrupt))
            if e.corrupt and self.drop_corrupt:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            elif e.corrupt:
                self._suspect.add((retention_class, key))
            return None
        except OSError:  # vanished or unreadable mid-read (e.g. a shared FS hiccup)
            self.stats.add(reads=1, misses=1)
            return None
        self.stats.add(reads=1, hits=1, bytes_read=dst.numel() * dst.element_size())
        return dst

    def _read_payload(self, f, key: str, out: torch.Tensor | None) -> torch.Tensor:
        h = parse_header(f)
        if h.fingerprint != self.fingerprint or h.key != key:
            raise BadBlock(f"block of {h.fingerprint}/{h.key}", corrupt=False)
        dtype = _DTYPES.get(h.dtype)
        if dtype is None:
            raise BadBlock(f"unknown dtype {h.dtype}", corrupt=False)
        if out is not None and (out.dtype != dtype or list(out.shape) != h.shape):
            raise BadBlock(f"block is {h.dtype}{h.shape}, wanted {out.dtype}{list(out.shape)}", corrupt=False)
        check_length(h, dtype.itemsize, os.fstat(f.fileno()).st_size)
        dst = out if out is not None else torch.empty(h.shape, dtype=dtype)
        view = _byte_view(dst)
        read_payload(f, view)
        check_checksum(h, view)
        return dst

    # --- other ---------------------------------------------------------------
    def contains(self, key: str, retention_class: str = "chat") -> bool:
        """Whether the block's file exists (not verified), and was not read as damaged here."""
        return (retention_class, key) not in self._suspect and self.path(key, retention_class).is_file()

    def delete(self, key: str, retention_class: str = "chat") -> bool:
        """Remove the block's file; True if it existed. OSError other than 'missing' propagates."""
        try:
            self.path(key, retention_class).unlink()
        except FileNotFoundError:
            return False
        return True
