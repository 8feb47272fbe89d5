"""The shared KV storage tier: block files named by prefix hash, the hash chain, the index client.

Torch is imported only when a tensor API is used (``BlockStore``,
``AsyncBlockStore``), so the kvindex service can read headers and scan the
tier without it.
"""

from deepinfer.kvstore.format import EPHEMERAL  # noqa: F401
from deepinfer.kvstore.hashing import block_hashes, model_fingerprint, root_hash  # noqa: F401

_LAZY = {
    "BlockStore": "deepinfer.kvstore.store",
    "ephemeral_key": "deepinfer.kvstore.store",
    "AsyncBlockStore": "deepinfer.kvstore.async_store",
    "WriteResult": "deepinfer.kvstore.async_store",
    "KVIndexClient": "deepinfer.kvstore.index_client",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deepinfer.kvstore' has no attribute {name!r}")
