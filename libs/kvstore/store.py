"""Block files on a (possibly shared) POSIX directory.

Layout: ``<root>/<model fingerprint>/<retention class>/<key[:2]>/<key>.kvb``.
File format (little-endian)::

    magic "DIKV" | u16 format version | u32 header length | header JSON | payload
    header: {"dtype": "float32", "shape": [...], "crc32": int, "nbytes": int}

Writes go to a temporary name in the same directory and are renamed into
place (atomic on POSIX), so a reader sees a whole block or none. Readers
verify length and CRC-32; a missing, truncated or corrupt block is a miss
(``None``), never an exception. Any shared file system (3FS FUSE, NFS,
CephFS) makes the tier shared across machines.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from pathlib import Path

import torch

MAGIC = b"DIKV"
FORMAT_VERSION = 1
EPHEMERAL = "ephemeral"

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def ephemeral_key(request_id: str, index: int) -> str:
    """Key of a request's partial last block (not content-addressed; deleted after use)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in request_id)
    return f"eph-{safe}-{index}"


class BlockStore:
    def __init__(self, root: str | Path, fingerprint: str):
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.base = self.root / fingerprint

    def path(self, key: str, retention_class: str) -> Path:
        return self.base / retention_class / key[:2] / f"{key}.kvb"

    def put(self, key: str, block: torch.Tensor, retention_class: str = "chat") -> int:
        """Write ``block`` (any shape; float32/bfloat16/float16) under ``key``. Returns bytes written."""
        block = block.contiguous()
        payload = block.view(torch.uint8).numpy().tobytes() if block.dtype != torch.uint8 else block.numpy().tobytes()
        header = json.dumps({
            "dtype": str(block.dtype).removeprefix("torch."), "shape": list(block.shape),
            "crc32": zlib.crc32(payload), "nbytes": len(payload),
        }).encode()
        path = self.path(key, retention_class)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<HI", FORMAT_VERSION, len(header)) + header)
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return len(payload)

    def get(self, key: str, retention_class: str = "chat") -> torch.Tensor | None:
        """Read a block; None when missing, truncated, of another format, or failing its checksum."""
        try:
            data = self.path(key, retention_class).read_bytes()
        except OSError:
            return None
        try:
            if data[:4] != MAGIC:
                return None
            version, hlen = struct.unpack("<HI", data[4:10])
            if version != FORMAT_VERSION:
                return None
            header = json.loads(data[10 : 10 + hlen])
            payload = memoryview(data)[10 + hlen :]
            if len(payload) != header["nbytes"] or zlib.crc32(payload) != header["crc32"]:
                return None
            dtype = _DTYPES[header["dtype"]]
            return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(header["shape"])
        except (ValueError, KeyError, struct.error, RuntimeError):
            return None

    def contains(self, key: str, retention_class: str = "chat") -> bool:
        return self.path(key, retention_class).exists()

    def delete(self, key: str, retention_class: str = "chat") -> None:
        self.path(key, retention_class).unlink(missing_ok=True)
