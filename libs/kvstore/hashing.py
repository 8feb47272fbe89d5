"""Chained block hashes (vLLM's prefix-caching hash, SHA-256).

    h_{-1} = SHA-256("deepinfer-root" ‖ model fingerprint)
    h_i    = SHA-256(h_{i-1} ‖ tokens of block i as little-endian u32 ‖ extra keys)

Only full blocks are hashed. ``extra`` (e.g. the template version, a tenant's
``cache_salt``) is mixed into block 0 and so into every later hash. ``images``
(multimodal prompts: ``(offset, length, content hash)`` of each image's run of
placeholder tokens) add to every block they overlap the image's offset, length
and hash (``image_keys``): the placeholders are the same token for every image, so
without this the same text with another image would name the same KV. SHA-256 is
stable across processes and machines and collision-resistant, so a hash never
names another tenant's KV (Python's ``hash`` is neither).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path


def model_fingerprint(model_dir: str | Path, dtype: str = "float32", block_size: int = 16, layout: str = "") -> str:
    """Stable id of (weights, KV dtype, block size, block layout): 16 hex chars.

    Hashes config.json and each safetensors file's size and header (the
    header lists every tensor's name, dtype, shape and offsets), so two copies
    of one checkpoint agree without reading gigabytes of weights. ``layout``
    names a block layout other than "every layer" (hybrid sliding-window
    models store "full-layers" only), so blocks of different layouts never
    share a directory ("" leaves the fingerprint as it always was).
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    h.update(json.dumps(json.loads((model_dir / "config.json").read_text()), sort_keys=True).encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h.update(fh.read(n))
        h.update(str(f.stat().st_size).encode())
    h.update(f"{dtype}/{block_size}".encode())
    if layout:
        h.update(f"/{layout}".encode())
    return h.hexdigest()[:16]


def root_hash(fingerprint: str) -> bytes:
    return hashlib.sha256(b"deepinfer-root" + fingerprint.encode()).digest()


def hash_block(prev: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """One link of the chain: SHA-256(prev ‖ tokens as LE u32 ‖ extra), 32 bytes."""
    h = hashlib.sha256(prev)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    if extra:
        h.update(extra)
    return h.digest()


def image_keys(images, start: int, end: int) -> bytes:
    """Extra keys of the block of tokens [start, end) for the images overlapping it.

    images: ``(offset, length, content hash as hex)`` of each image's placeholder run, in any order.
    Each overlapping image adds ``b"img" ‖ offset as LE u32 ‖ length as LE u32 ‖ hash bytes``,
    in offset order (b"" when none overlaps, so text-only hashes are unchanged).
    """
    out = b""
    for offset, length, digest in sorted(images or ()):
        if offset < end and offset + length > start:
            out += b"img" + struct.pack("<II", offset, length) + bytes.fromhex(digest)
    return out


def extend_hashes(hashes: list[str], token_ids: list[int], block_size: int, fingerprint: str,
                  extra: bytes = b"", images=()) -> list[str]:
    """Append to ``hashes`` the hex hashes of the full blocks of ``token_ids`` not hashed yet.

    ``hashes`` must be the chain of the first ``len(hashes)`` blocks of these
    tokens (as this function built it, with the same ``images``); returns the same list.
    images: see ``image_keys``.
    """
    prev = bytes.fromhex(hashes[-1]) if hashes else root_hash(fingerprint)
    for i in range(len(hashes), len(token_ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        keys = (extra if i == 0 else b"") + (image_keys(images, start, end) if images else b"")
        prev = hash_block(prev, token_ids[start:end], keys)
        hashes.append(prev.hex())
    return hashes


def block_hashes(token_ids: list[int], block_size: int, fingerprint: str, extra: bytes = b"",
                 images=()) -> list[str]:
    """Hex hashes of the full blocks of ``token_ids`` (len // block_size of them); images: see ``image_keys``."""
    return extend_hashes([], token_ids, block_size, fingerprint, extra, images)


def embeddings_fingerprint(model_dir: str | Path, dtype: str = "float32") -> str:
    """Directory name of a model's image embeddings in the storage tier (``<root>/<this>/embeddings/``):
    the model fingerprint of (weights, the vision worker's dtype), with no block size."""
    return model_fingerprint(model_dir, dtype, 0, "embeddings")
