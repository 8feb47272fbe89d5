"""The shared KV storage tier: block files named by prefix hash, and the hash chain."""

from deepinfer.kvstore.hashing import block_hashes, model_fingerprint, root_hash  # noqa: F401
from deepinfer.kvstore.store import BlockStore, ephemeral_key  # noqa: F401
