"""Walk the storage tier: every indexable block file with its metadata (the kvindex's replay).

Reads only headers (a few hundred bytes per file), never payloads, so a
replay costs one open + one small read per block. Ephemeral blocks (a
request's partial last block) are skipped: they are never indexed; so are
images' embeddings (``kvstore.embeddings``: not KV blocks, outside the
kvindex's retention and capacity).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from deepinfer.kvstore.format import EMBEDDINGS, EPHEMERAL, SUFFIX, SAFE_NAME, read_header


@dataclass
class BlockFile:
    """One block file. nbytes: payload bytes; num_tokens: from the header (None if unrecorded);
    mtime: last modification, seconds since the epoch (when it was written)."""

    fingerprint: str
    retention_class: str
    key: str
    path: Path
    nbytes: int
    num_tokens: int | None
    mtime: float


def fingerprints(root: str | Path) -> list[str]:
    """Fingerprint directories under ``root`` ([] when the root does not exist)."""
    try:
        return sorted(e.name for e in os.scandir(root) if e.is_dir() and SAFE_NAME.fullmatch(e.name))
    except OSError:
        return []


def scan_blocks(root: str | Path, fingerprint: str | None = None) -> Iterator[BlockFile]:
    """Yield every valid, non-ephemeral block file under ``root`` (one fingerprint, or all).

    Files whose header is invalid, or names another fingerprint or key than
    its path, are skipped (a reader would miss on them anyway); temporary
    files of writes in progress too. Unreadable directories are skipped;
    never raises OSError.
    """
    fps = [fingerprint] if fingerprint is not None else fingerprints(root)
    for fp in fps:
        for cls_dir in _subdirs(Path(root) / fp):
            if cls_dir.name in (EPHEMERAL, EMBEDDINGS) or not SAFE_NAME.fullmatch(cls_dir.name):
                continue
            for e in _shard_entries(cls_dir):
                if not e.name.endswith(SUFFIX) or e.name.startswith("."):
                    continue
                bf = _read_block_file(Path(e.path), fp, cls_dir.name, e.name[: -len(SUFFIX)])
                if bf is not None:
                    yield bf


def _shard_entries(cls_dir: Path) -> Iterator[os.DirEntry]:
    """Every entry of every shard directory of a class directory (unreadable shards skipped)."""
    for shard in _subdirs(cls_dir):
        try:
            yield from list(os.scandir(shard))
        except OSError:
            continue


def _with_mtime(entries: Iterable[os.DirEntry]) -> Iterator[tuple[Path, float]]:
    for e in entries:
        try:
            yield Path(e.path), e.stat().st_mtime
        except OSError:  # gone meanwhile
            continue


def _subdirs(d: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(d) if e.is_dir()]
    except OSError:
        return []


def _read_block_file(path: Path, fp: str, cls: str, key: str) -> BlockFile | None:
    try:
        with open(path, "rb") as f:
            h = read_header(f)
            st = os.fstat(f.fileno())
    except OSError:
        return None
    if h is None or h.fingerprint != fp or h.key != key:
        return None
    return BlockFile(fp, cls, key, path, h.nbytes, h.num_tokens, st.st_mtime)


def ephemeral_files(root: str | Path) -> Iterator[tuple[Path, float]]:
    """``(path, mtime)`` of every ephemeral block file under ``root`` (orphans are cleaned by age)."""
    for fp in fingerprints(root):
        yield from _with_mtime(_shard_entries(Path(root) / fp / EPHEMERAL))


def temp_files(root: str | Path) -> Iterator[tuple[Path, float]]:
    """``(path, mtime)`` of every temporary file of a block write (``.tmp-*``, renamed into place
    when whole) under ``root``, in every class: one a killed writer left stays until swept by age."""
    for fp in fingerprints(root):
        for cls_dir in _subdirs(Path(root) / fp):
            yield from _with_mtime(e for e in _shard_entries(cls_dir) if e.name.startswith(".tmp-"))
