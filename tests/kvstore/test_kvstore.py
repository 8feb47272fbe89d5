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


# ---------------------------------------------------------------- format v2, read_into

import json  # noqa: E402
import struct  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402

from deepinfer.kvstore import AsyncBlockStore  # noqa: E402
from deepinfer.kvstore.format import FORMAT_VERSION, MAGIC, PREFIX, read_header  # noqa: E402
from deepinfer.kvstore.scan import scan_blocks  # noqa: E402
from waiting import eventually  # noqa: E402


def test_header_records_fingerprint_key_and_tokens(tmp_path):
    store = BlockStore(tmp_path, "fp1")
    store.put("ab12", torch.zeros(2, 3), num_tokens=16)
    with open(store.path("ab12", "chat"), "rb") as f:
        h = read_header(f)
    assert (h.fingerprint, h.key, h.dtype, h.shape, h.nbytes, h.num_tokens) == ("fp1", "ab12", "float32", [2, 3], 24, 16)


def test_read_into_fills_the_callers_tensor_bit_exactly(tmp_path):
    store = BlockStore(tmp_path, "fp")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        block = torch.randn(3, 2, 16, 2, 8).to(dtype)
        store.put("aa11", block)
        out = torch.full_like(block, 7)
        ptr = out.data_ptr()
        assert store.read_into("aa11", "chat", out) is True
        assert out.data_ptr() == ptr  # filled in place, not replaced
        assert torch.equal(out.view(torch.uint8), block.view(torch.uint8))
    s = store.stats.snapshot()
    assert s["hits"] == 3 and s["misses"] == 0 and s["bytes_read"] == sum(
        3 * 2 * 16 * 2 * 8 * d.itemsize for d in (torch.float32, torch.bfloat16, torch.float16))


def test_read_into_refuses_non_contiguous_out(tmp_path):
    store = BlockStore(tmp_path, "fp")
    store.put("aa11", torch.ones(4, 4))
    with pytest.raises(ValueError):
        store.read_into("aa11", "chat", torch.empty(4, 4).t())


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-5] ^= 0x01
    elif how == "truncate":
        data = data[:-8]
    elif how == "trailing":
        data += b"x"
    elif how == "header":
        data = data[:12]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "trailing", "header"])
def test_damaged_block_is_a_miss_counted_left_in_place_and_replaced_by_the_next_writer(tmp_path, how):
    """A reader never deletes what it failed to verify (on a shared file system it may have seen a
    stale version of a file another host has replaced): the block is a miss, counted, and this
    store's ``contains`` says it is absent, so its next writer replaces it; a store made to drop
    damaged files (the kvindex's) deletes it."""
    store = BlockStore(tmp_path, "fp")
    block = torch.randn(4, 8)
    store.put("cd34", block)
    path = store.path("cd34", "chat")
    _damage(path, how)
    assert store.read_into("cd34", "chat", torch.empty(4, 8)) is False
    s = store.stats.snapshot()
    assert (s["misses"], s["corrupt"], s["hits"]) == (1, 1, 0)
    assert path.exists() and not store.contains("cd34", "chat")
    assert not BlockStore(tmp_path, "fp").contains("cd34", "chat")  # nor for another store of this process
    store.put("cd34", block)
    assert store.contains("cd34", "chat") and torch.equal(store.get("cd34"), block)
    _damage(path, how)
    assert BlockStore(tmp_path, "fp", drop_corrupt=True).get("cd34") is None and not path.exists()


@pytest.mark.parametrize("how", ["flip", "truncate", "trailing", "header", None])
def test_verify_block_checks_a_file_as_a_load_does_without_torch(tmp_path, how):
    """``format.verify_block`` (the kvindex's re-check): a good block passes, a damaged one is
    corrupt, another model's block is foreign (not corrupt); its dtype table is the store's."""
    from deepinfer.kvstore.format import DTYPE_BYTES, BadBlock, verify_block
    from deepinfer.kvstore.store import _DTYPES

    assert DTYPE_BYTES == {name: d.itemsize for name, d in _DTYPES.items()}
    store = BlockStore(tmp_path, "fp")
    store.put("cd34", torch.randn(4, 8, dtype=torch.bfloat16))
    path = store.path("cd34", "chat")
    with pytest.raises(BadBlock) as foreign:
        verify_block(path, "fp2", "cd34")
    assert not foreign.value.corrupt
    if how is None:
        verify_block(path, "fp", "cd34")
        return
    _damage(path, how)
    with pytest.raises(BadBlock) as damaged:
        verify_block(path, "fp", "cd34")
    assert damaged.value.corrupt


def test_verify_block_reads_through_short_reads(tmp_path, monkeypatch):
    """A network file system may return fewer bytes than asked: still a good block, not a truncated one."""
    import io

    from deepinfer.kvstore import format as fmt

    store = BlockStore(tmp_path, "fp")
    store.put("cd35", torch.randn(64, 64))

    class Trickle(io.FileIO):  # at most 1,000 bytes a call, however it is read
        def readinto(self, b):
            return super().readinto(memoryview(b)[:1000])

        def read(self, n=-1):
            return super().read(1000 if n is None or n < 0 or n > 1000 else n)

    monkeypatch.setattr(fmt, "open", lambda path, *a, **k: Trickle(path, "rb"), raising=False)
    fmt.verify_block(store.path("cd35", "chat"), "fp", "cd35")


def test_missing_wrong_shape_wrong_dtype_and_other_fingerprint_are_misses(tmp_path):
    store = BlockStore(tmp_path, "fp")
    assert store.read_into("nothere", "chat", torch.empty(2)) is False
    store.put("ef56", torch.randn(2, 4))
    assert store.read_into("ef56", "chat", torch.empty(4, 2)) is False
    assert store.read_into("ef56", "chat", torch.empty(2, 4, dtype=torch.float16)) is False
    assert store.read_into("ef56", "agent", torch.empty(2, 4)) is False  # another class is another file
    # a file of another model fingerprint placed under this one's directory is foreign
    other = BlockStore(tmp_path, "fp2")
    other.put("ef57", torch.randn(2, 4))
    dst = store.path("ef57", "chat")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(other.path("ef57", "chat").read_bytes())
    assert store.read_into("ef57", "chat", torch.empty(2, 4)) is False
    assert store.get("ef57") is None
    assert dst.exists()  # foreign, not corrupt: left alone
    assert store.stats.snapshot()["corrupt"] == 0
    # the right one still reads
    assert store.read_into("ef56", "chat", torch.empty(2, 4)) is True


def test_old_format_version_is_a_miss(tmp_path):
    store = BlockStore(tmp_path, "fp")
    path = store.path("aa00", "chat")
    path.parent.mkdir(parents=True)
    body = json.dumps({"dtype": "float32", "shape": [1], "xxh3": 0, "nbytes": 4}).encode()
    path.write_bytes(MAGIC + struct.pack("<HI", FORMAT_VERSION - 1, len(body)) + body + b"\0" * 4)
    assert store.get("aa00") is None and path.exists()
    assert PREFIX.size == 10


def test_read_prefix_into_stops_at_the_first_miss(tmp_path):
    store = BlockStore(tmp_path, "fp")
    blocks = torch.randn(4, 2, 8)
    for i in (0, 1, 3):
        store.put(f"k{i}", blocks[i])
    out = torch.zeros(4, 2, 8)
    assert store.read_prefix_into([f"k{i}" for i in range(4)], "chat", out) == 2
    assert torch.equal(out[:2], blocks[:2])


def test_unsafe_names_are_refused(tmp_path):
    store = BlockStore(tmp_path, "fp")
    with pytest.raises(ValueError):
        store.put("../../etc", torch.zeros(1))
    with pytest.raises(ValueError):
        store.put("aa11", torch.zeros(1), "../x")


def test_scan_lists_indexable_blocks_only(tmp_path):
    store = BlockStore(tmp_path, "fp")
    store.put("aa11", torch.zeros(4), "chat", num_tokens=16)
    store.put("bb22", torch.zeros(4), "agent")
    store.put(ephemeral_key("r1", 0), torch.zeros(4), "ephemeral")
    (store.path("cc33", "chat").parent).mkdir(parents=True)
    store.path("cc33", "chat").write_bytes(b"garbage")
    found = {(b.fingerprint, b.retention_class, b.key, b.nbytes, b.num_tokens) for b in scan_blocks(tmp_path)}
    assert found == {("fp", "chat", "aa11", 16, 16), ("fp", "agent", "bb22", 16, None)}


# ------------------------------------------------------------- async + write-behind


async def test_write_behind_returns_at_once_and_flush_writes_everything(tmp_path):
    astore = AsyncBlockStore(BlockStore(tmp_path, "fp"))
    blocks = [torch.randn(2, 16) for _ in range(6)]
    gate = threading.Event()
    real_put = astore.store.put

    def slow_put(*a, **kw):  # hold the writer until the caller got control back
        gate.wait(5)
        return real_put(*a, **kw)

    astore.store.put = slow_put
    done = []
    assert astore.submit_puts([(f"k{i}", b) for i, b in enumerate(blocks)], "chat", num_tokens=16,
                              on_done=done.append)
    for b in blocks:
        b.fill_(0)  # the caller reuses its memory at once: the queue holds copies
    assert not any(astore.store.contains(f"k{i}", "chat") for i in range(6))
    gate.set()
    assert await astore.aflush(5)
    await eventually(lambda: done)  # on_done runs on this loop, scheduled by the writer thread
    assert [r.status for r in done[0]] == ["written"] * 6
    out = torch.empty(6, 2, 16)
    assert await astore.read_prefix_into([f"k{i}" for i in range(6)], "chat", out) == 6
    assert not torch.equal(out, torch.zeros_like(out))
    # a second submit of existing blocks is skipped, not rewritten
    assert astore.submit_put("k0", torch.ones(2, 16), "chat")
    assert await astore.aflush(5)
    assert astore.stats.snapshot()["writes_skipped"] == 1 and astore.stats.snapshot()["writes"] == 6
    astore.close()


async def test_write_behind_queue_full_drops_and_counts(tmp_path):
    astore = AsyncBlockStore(BlockStore(tmp_path, "fp"), max_pending_bytes=1000)
    gate = threading.Event()
    real_put = astore.store.put
    astore.store.put = lambda *a, **kw: (gate.wait(5), real_put(*a, **kw))[1]
    b = torch.zeros(100)  # 400 bytes
    assert astore.submit_put("a1", b) and astore.submit_put("a2", b)
    dropped = []
    assert astore.submit_put("a3", b, on_done=dropped.append) is False
    gate.set()
    assert await astore.aflush(5)
    assert astore.stats.snapshot()["writes_dropped"] == 1
    assert dropped[0][0].status == "dropped"
    assert not astore.store.contains("a3", "chat") and astore.store.contains("a2", "chat")
    astore.close()


async def test_unwritable_root_skips_writes_without_raising(tmp_path):
    # NOTE: tests run as root here, so chmod cannot make a directory read-only;
    # a regular file where the fingerprint directory should be fails the same way (OSError).
    (tmp_path / "fp").write_bytes(b"not a directory")
    astore = AsyncBlockStore(BlockStore(tmp_path, "fp"))
    results = []
    for i in range(3):
        assert astore.submit_put(f"k{i}", torch.zeros(8), on_done=results.extend)
    assert await astore.aflush(5)
    assert await astore.put("k9", torch.zeros(8)) == 0  # the awaited write does not raise either
    await eventually(lambda: len(results) >= 3)  # the three on_done callbacks, run on this loop
    assert [r.status for r in results] == ["error"] * 3
    assert astore.stats.snapshot()["write_errors"] == 4 and astore.stats.snapshot()["writes"] == 0
    assert await astore.read_into("k0", "chat", torch.empty(8)) is False
    astore.close()


async def test_read_only_file_system_error_is_counted_not_raised(tmp_path, monkeypatch):
    import errno
    import tempfile as tempfile_mod

    def erofs(*a, **kw):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile_mod, "mkstemp", erofs)
    astore = AsyncBlockStore(BlockStore(tmp_path, "fp"))
    assert astore.submit_put("k0", torch.zeros(8))
    assert await astore.aflush(5)
    assert astore.stats.snapshot()["write_errors"] == 1
    monkeypatch.undo()
    assert astore.submit_put("k1", torch.zeros(8))  # storage back: writes resume
    assert await astore.aflush(5)
    assert astore.store.contains("k1", "chat")
    astore.close()


async def test_async_read_prefix_into_counts_the_prefix_across_parallel_runs(tmp_path):
    astore = AsyncBlockStore(BlockStore(tmp_path, "fp"), io_threads=3)
    blocks = torch.randn(7, 4, 8)
    for i in range(7):
        if i != 4:  # a miss in the second run
            astore.store.put(f"k{i}", blocks[i])
    out = torch.zeros(7, 4, 8)
    keys = [f"k{i}" for i in range(7)]
    assert await astore.read_prefix_into(keys, "chat", out) == 4
    assert torch.equal(out[:4], blocks[:4])
    assert await astore.read_prefix_into(keys[:4], "chat", out) == 4
    assert await astore.read_prefix_into([], "chat", out) == 0
    astore.close()


def test_a_tier_has_one_identity_however_many_look_at_once(tmp_path):
    """Every process that looks at a root gets the same id, also when they look at once (the first
    write wins); another root is another tier."""
    from concurrent.futures import ThreadPoolExecutor

    from deepinfer.kvstore.store import tier_id

    with ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(lambda _: tier_id(tmp_path / "shared"), range(32)))
    assert len(ids) == 1 and len(ids.pop()) == 32
    assert BlockStore(tmp_path / "shared", "fp").tier_id == tier_id(tmp_path / "shared")
    assert tier_id(tmp_path / "private") != tier_id(tmp_path / "shared")
    assert [p.name for p in (tmp_path / "shared").iterdir()] == [".tier-id"]  # no temporary file left


def test_ephemeral_blocks_spread_over_the_shard_directories_and_are_told_from_prefix_hashes(tmp_path):
    """Handoff blocks of many requests land in many shard directories (by their key's first two
    characters), not one; ``is_ephemeral`` tells their keys from content hashes."""
    from deepinfer.kvstore.store import EPHEMERAL, ephemeral_key, is_ephemeral

    store = BlockStore(tmp_path, "fp")
    keys = [ephemeral_key(f"req-{i}", 0) for i in range(64)] + [ephemeral_key("req-0", 1, "w")]
    shards = {store.path(k, EPHEMERAL).parent.name for k in keys}
    assert len(shards) > 30
    assert all(is_ephemeral(k) for k in keys) and not any(is_ephemeral(h) for h in block_hashes(list(range(64)), 16, "fp"))
    assert len(set(keys)) == len(keys)
