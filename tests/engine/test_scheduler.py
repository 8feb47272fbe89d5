"""Scheduler and block manager without a model: they move integers only."""

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.cost_model import StepCostModel
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import RequestStatus, Sequence
from deepinfer.protocol import SamplingParams

EOS = 2


def make(num_blocks=8, block_size=4, max_num_seqs=8, budget=64, max_len=100, time_budget=None, cost=None,
         lone_factor=1):
    """(lone_factor 1: a lone sequence gets the plain time budget, unless a test asks otherwise)"""
    bm = BlockManager(num_blocks, block_size, "fp")
    return bm, Scheduler(bm, max_num_seqs, budget, max_len, [EOS], cost, time_budget, min_chunk=block_size,
                         lone_budget_factor=lone_factor)


def seq(rid, n, max_tokens=10, first=10, **kw):
    return Sequence(rid, list(range(first, first + n)), n, SamplingParams(temperature=0, max_tokens=max_tokens, **kw))


def test_prefill_then_decode_allocates_blocks_as_sequences_grow():
    bm, s = make()
    a, b = seq("a", 5), seq("b", 3)
    s.add(a), s.add(b)
    assert s.schedule() == [a, b]
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    s.postprocess([a, b], {0: 50, 1: 51})
    assert a.num_computed_tokens == 5 and len(a) == 6
    assert s.schedule() == [a, b]  # decode step: both fit
    assert bm.num_free_blocks == 8 - 3


def test_finish_reasons_stop_length_and_ignore_eos():
    _, s = make()
    a, b, c = seq("a", 3, max_tokens=5), seq("b", 3, max_tokens=1), seq("c", 3, ignore_eos=True)
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    done = s.postprocess([a, b, c], {0: EOS, 1: 7, 2: EOS})
    assert [x.request_id for x in done] == ["a", "b"]
    assert a.finish_reason == "stop" and b.finish_reason == "length" and c.finish_reason is None


def test_stop_token_ids_finish_with_stop():
    _, s = make()
    a = seq("a", 3, stop_token_ids=[42])
    s.add(a)
    s.schedule()
    assert s.postprocess([a], {0: 42}) == [a] and a.finish_reason == "stop"


def test_token_budget_chunks_prefills():
    _, s = make(budget=8)
    a, b = seq("a", 6), seq("b", 6, first=30)  # (other prompts: an identical one would wait for a's blocks)
    s.add(a), s.add(b)
    assert s.schedule() == [a, b]
    assert (a.num_scheduled_tokens, b.num_scheduled_tokens) == (6, 2)
    s.postprocess([a, b], {0: 50})  # b's chunk did not reach its end: no token
    assert len(a) == 7 and len(b) == 6 and b.num_computed_tokens == 2
    assert s.schedule() == [a, b] and (a.num_scheduled_tokens, b.num_scheduled_tokens) == (1, 4)


def test_time_budget_cuts_shorter_chunks_at_longer_context():
    cost = StepCostModel(a=0.0, b=1e-3, d=1e-4)
    _, s = make(num_blocks=512, block_size=4, budget=10_000, time_budget=0.2, cost=cost)
    long = seq("long", 1000)
    s.add(long)
    s.schedule()
    first = long.num_scheduled_tokens
    assert cost.piece_cost(first, 0) <= 0.2 < cost.piece_cost(first + 1, 0)
    s.postprocess([long], {})
    s.schedule()
    second = long.num_scheduled_tokens
    assert second < first  # same time, more context -> fewer tokens
    assert cost.piece_cost(second, first) <= 0.2 < cost.piece_cost(second + 1, first)


def test_decodes_are_scheduled_even_past_the_time_budget():
    cost = StepCostModel(a=0.0, b=1.0, d=0.0)  # every token "costs" a second
    _, s = make(time_budget=0.5, cost=cost)
    a = seq("a", 3)
    s.add(a)
    s.schedule()
    s.postprocess([a], {0: 9})
    b = seq("b", 12)
    s.add(b)
    assert s.schedule() == [a, b]
    assert a.num_scheduled_tokens == 1 and b.num_scheduled_tokens == 4  # min chunk = block size


def test_preemption_frees_blocks_and_requeues_for_recompute():
    bm, s = make(num_blocks=2, block_size=4)
    a, b = seq("a", 4), seq("b", 4)
    s.add(a), s.add(b)
    assert s.schedule() == [a, b]
    s.postprocess([a, b], {0: 60, 1: 61})  # both now need a 2nd block; only 0 free
    scheduled = s.schedule()
    assert scheduled == [a]  # b preempted so a can continue
    assert b.status == RequestStatus.WAITING and b.block_table == [] and s.waiting[0] is b
    assert s.num_preemptions == 1
    assert bm.num_free_blocks == 0


def test_abort_frees_blocks():
    bm, s = make()
    a = seq("a", 9)
    s.add(a)
    s.schedule()
    assert bm.num_free_blocks == 5
    assert s.abort("a") is a and bm.num_free_blocks == 8 and not s.has_unfinished()
    assert s.abort("a") is None


def test_prefix_cache_hits_skip_computed_blocks_and_leave_one_token():
    bm, s = make(num_blocks=16, block_size=4)
    a = seq("a", 10)
    s.add(a)
    s.schedule()
    s.postprocess([a], {0: 99})
    s.abort("a")  # finished: blocks freed but their hashes stay cached
    b = Sequence("b", list(range(10, 20)) + [7, 7], 12, SamplingParams(temperature=0))
    s.add(b)
    s.schedule()
    assert b.num_cached_tokens == 8 and b.num_scheduled_tokens == 4
    exact = seq("c", 8)  # fully cached prompt: one block is recomputed for the logits
    s.add(exact)
    s.schedule()
    assert exact.num_cached_tokens == 4 and exact.num_scheduled_tokens == 4
    assert bm.num_hit_tokens == 12


def test_cache_salt_isolates_tenants():
    bm, s = make(num_blocks=16, block_size=4)
    a = Sequence("a", list(range(12)), 12, SamplingParams(), cache_salt=b"tenant-1")
    s.add(a)
    s.schedule()
    s.postprocess([a], {0: 5})
    b = Sequence("b", list(range(12)), 12, SamplingParams(), cache_salt=b"tenant-2")
    assert bm.find_cached_prefix(b) == []
    c = Sequence("c", list(range(12)), 12, SamplingParams(), cache_salt=b"tenant-1")
    assert len(bm.find_cached_prefix(c)) == 2


def test_lru_evicts_least_recently_freed_cached_blocks_first():
    bm = BlockManager(4, 2, "fp")
    old, new = Sequence("o", [1, 2, 3, 4], 4, SamplingParams()), Sequence("n", [5, 6, 7, 8], 4, SamplingParams())
    for x in (old, new):
        bm.allocate(x, 4)
        x.num_computed_tokens = 4
        bm.cache_computed_blocks(x)
    bm.free(old)
    bm.free(new)
    assert len(bm.cached) == 4 and bm.num_free_blocks == 4
    grab = Sequence("g", [0] * 4, 4, SamplingParams())
    bm.allocate(grab, 4)  # takes 2 blocks: old's are evicted, new's survive
    assert bm.find_cached_prefix(Sequence("n2", [5, 6, 7, 8, 9], 5, SamplingParams())) != []
    assert bm.find_cached_prefix(Sequence("o2", [1, 2, 3, 4, 9], 5, SamplingParams())) == []


def test_chunk_time_is_floored_at_the_fixed_step_cost():
    """A fixed cost near the budget must not shrink every chunk to min_chunk (docs/benchmarks.md)."""
    cost = StepCostModel(a=0.2, b=1e-3, d=0.0)  # 0.2 s per step of a 0.25 s budget
    _, s = make(num_blocks=512, block_size=4, budget=10_000, time_budget=0.25, cost=cost)
    long = seq("long", 1000)
    s.add(long)
    s.schedule()
    assert long.num_scheduled_tokens == 200  # 0.2 s of tokens at 1 ms each, not 0.05 s (50)
    cost.a = 0.05  # a small fixed cost: the budget less it
    s.postprocess([long], {})
    s.schedule()
    assert long.num_scheduled_tokens == 200  # 0.25 - 0.05 = 0.2 s
    cost.a = 0.01
    s.postprocess([long], {})
    s.schedule()
    assert long.num_scheduled_tokens == 240


def test_at_a_long_context_a_chunk_takes_at_least_the_step_fixed_cost_in_tokens():
    """Where the fixed cost (a + e c) alone exceeds the budget, the first chunk still spends as long
    on tokens as on that fixed cost, not min_chunk's worth (an 8k-token prompt took 441 steps)."""
    cost = StepCostModel(a=0.1, b=1e-3, d=1e-6, e=2e-5)
    _, s = make(num_blocks=4096, block_size=4, budget=10_000, max_len=10_000, time_budget=0.25, cost=cost)
    long, other = seq("long", 9000), seq("other", 40, first=5000)
    s.add(long)
    long.num_computed_tokens = 8000  # (as if its earlier chunks ran)
    s.add(other)  # competing: long is not alone, so the plain budget applies
    s.running.append(s.waiting.popleft())
    long.status = RequestStatus.RUNNING
    assert cost.a + cost.e * 8000 > 0.25  # the budget alone would leave min_chunk
    s.schedule()
    n = long.num_scheduled_tokens
    tokens = cost.piece_cost(n, 8000) - cost.e * 8000
    assert n == cost.efficient_chunk(8000) > 4 * s.min_chunk
    assert tokens <= cost.a + cost.e * 8000 < tokens + cost.b + cost.d * 8000 * 2  # about the fixed cost


def test_a_lone_sequence_gets_a_larger_budget_and_loses_it_when_another_arrives():
    cost = StepCostModel(a=0.0, b=1e-3, d=0.0)
    _, s = make(num_blocks=512, block_size=4, budget=10_000, time_budget=0.2, cost=cost, lone_factor=4)
    long = seq("long", 1000)
    s.add(long)
    s.schedule()
    assert long.num_scheduled_tokens == 800  # alone: 4 x 0.2 s at 1 ms a token
    s.postprocess([long], {})
    s.add(seq("short", 10, first=3000))
    s.schedule()
    assert long.num_scheduled_tokens == 100  # someone waits: 0.2 s, halved while they wait


def test_a_prefix_being_computed_is_waited_for_then_hit_not_computed_twice():
    """In-flight prefix sharing: b and c share a's first 3 blocks and arrive with it; d does not.
    b and c wait while a computes those blocks (d goes ahead), then hit them."""
    bm, s = make(num_blocks=32, budget=64)
    prefix = list(range(100, 112))  # 3 blocks of 4
    a, b, c = (Sequence(r, prefix + [200 + i, 201 + i], 14, SamplingParams(temperature=0, max_tokens=3))
               for i, r in enumerate("abc"))
    d = seq("d", 6, first=50)
    for x in (a, b, c, d):
        s.add(x)
    assert s.schedule() == [a, d]  # b, c keep their place in the queue
    assert list(s.waiting) == [b, c] and s.num_deferred == 2
    s.postprocess([a, d], {0: 7, 1: 8})
    assert s.schedule() == [a, d, b, c]  # a's blocks are computed now: b and c hit them
    assert b.num_cached_tokens == c.num_cached_tokens == 12
    assert b.num_scheduled_tokens == c.num_scheduled_tokens == 2


def test_prefill_chunks_of_a_shared_prefix_are_waited_for_chunk_by_chunk():
    """With a step budget that cuts a's prompt into chunks, b follows a block by block: it is
    admitted once the block after its cached part is not in flight any more (never computes a
    block a computes)."""
    bm, s = make(num_blocks=32, budget=8)
    prefix = list(range(100, 116))  # 4 blocks
    a = Sequence("a", prefix + [1], 17, SamplingParams(temperature=0, max_tokens=2))
    b = Sequence("b", prefix + [2], 17, SamplingParams(temperature=0, max_tokens=2))
    s.add(a), s.add(b)
    fed = {"a": 0, "b": 0}
    for _ in range(50):  # (a bound: a deadlock fails here instead of hanging)
        if a.num_computed_tokens >= 17 and b.num_computed_tokens >= 17:
            break
        step = s.schedule()
        for x in step:
            fed[x.request_id] += x.num_scheduled_tokens
        s.postprocess(step, {i: 9 for i, x in enumerate(step) if x.num_computed_tokens + x.num_scheduled_tokens >= len(x)})
    assert a.num_computed_tokens >= 17 and b.num_computed_tokens >= 17, "no progress"
    assert fed == {"a": 17, "b": 1} and b.num_cached_tokens == 16


def test_imported_kv_waits_for_a_slot_when_the_batch_is_full_then_decodes():
    """A handoff's sequence (its KV imported, status RUNNING) into a full batch waits in ``waiting``
    with its blocks, counted there, and joins as a decode when a slot frees: ``max_num_seqs`` bounds
    a decode worker's batch whatever way requests arrive."""
    bm, s = make(num_blocks=16, max_num_seqs=1)
    a = seq("a", 3, max_tokens=2)
    s.add(a)
    s.schedule()
    s.postprocess([a], {0: 9})  # a decodes now
    b = seq("b", 5, first=40)
    b.num_computed_tokens = 4  # every token but the last, as a handoff brings it
    bm.allocate(b, 5)
    b.status = RequestStatus.RUNNING
    s.add(b)
    assert list(s.waiting) == [b] and list(s.running) == [a] and b.block_table
    assert s.schedule() == [a]  # the batch is full: b keeps waiting, with its blocks
    s.postprocess([a], {0: 9})  # a's second token: max_tokens, it finishes and frees its slot
    assert a.status.is_finished
    assert s.schedule() == [b] and b.num_scheduled_tokens == 1 and list(s.running) == [b] and not s.waiting
