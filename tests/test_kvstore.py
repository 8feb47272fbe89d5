import torch

from deepinfer.kvstore import BlockStore, block_hashes, ephemeral_key


def test_block_roundtrip_is_bit_exact(tmp_path):
    store = BlockStore(tmp_path, "fp")
    for dtype in (torch.float32, torch.bfloat16):
        block = torch.randn(4, 2, 16, 3, 8).to(dtype)
        store.put("aa11", block)
        got = store.get("aa11")
        assert got.dtype == dtype and torch.equal(got, block)


def test_missing_truncated_or_corrupt_block_is_a_miss(tmp_path):
    store = BlockStore(tmp_path, "fp")
    assert store.get("missing") is None
    store.put("bb22", torch.ones(2, 3))
    path = store.path("bb22", "chat")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get("bb22") is None
    path.write_bytes(bytes(data[:20]))
    assert store.get("bb22") is None
    path.write_bytes(b"garbage")
    assert store.get("bb22") is None


def test_write_is_atomic_no_temp_files_left(tmp_path):
    store = BlockStore(tmp_path, "fp")
    store.put("cc33", torch.zeros(8))
    files = [p.name for p in (tmp_path / "fp").rglob("*") if p.is_file()]
    assert files == ["cc33.kvb"]


def test_block_hashes_chain_and_cover_full_blocks_only():
    toks = list(range(40))
    h = block_hashes(toks, 16, "fp")
    assert len(h) == 2
    # same prefix -> same hashes; a change in block 0 changes every later hash
    assert block_hashes(toks[:32] + [7, 7], 16, "fp") == h
    changed = block_hashes([99] + toks[1:], 16, "fp")
    assert changed[0] != h[0] and changed[1] != h[1]
    # the model fingerprint and extra keys (cache_salt) are part of the chain
    assert block_hashes(toks, 16, "other")[0] != h[0]
    assert block_hashes(toks, 16, "fp", extra=b"salt")[1] != h[1]
    assert all(len(x) == 64 for x in h)


def test_ephemeral_keys_are_path_safe():
    assert "/" not in ephemeral_key("a/../b", 3)
