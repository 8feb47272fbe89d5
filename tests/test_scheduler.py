"""Scheduler and block manager without a model: they move integers only."""

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import Sequence, SequenceStatus
from deepinfer.protocol import SamplingParams

EOS = 2


def make(num_blocks=8, block_size=4, max_num_seqs=8, budget=64, max_len=100):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, max_num_seqs, budget, max_len, [EOS])


def seq(rid, n, max_tokens=10, **kw):
    return Sequence(rid, list(range(10, 10 + n)), n, SamplingParams(temperature=0, max_tokens=max_tokens, **kw))


def test_prefill_then_decode_allocates_blocks_as_sequences_grow():
    bm, s = make()
    a, b = seq("a", 5), seq("b", 3)
    s.add(a), s.add(b)
    assert s.schedule() == [a, b]
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    s.postprocess([a, b], [50, 51])
    assert a.num_computed_tokens == 5 and len(a) == 6
    assert s.schedule() == [a, b]  # decode step: both fit
    assert bm.num_free_blocks == 8 - 3


def test_finish_reasons_stop_length_and_ignore_eos():
    _, s = make()
    a, b, c = seq("a", 3, max_tokens=5), seq("b", 3, max_tokens=1), seq("c", 3, ignore_eos=True)
    for x in (a, b, c):
        s.add(x)
    s.schedule()
    done = s.postprocess([a, b, c], [EOS, 7, EOS])
    assert [x.request_id for x in done] == ["a", "b"]
    assert a.finish_reason == "stop" and b.finish_reason == "length" and c.finish_reason is None


def test_stop_token_ids_finish_with_stop():
    _, s = make()
    a = seq("a", 3, stop_token_ids=[42])
    s.add(a)
    s.schedule()
    assert s.postprocess([a], [42]) == [a] and a.finish_reason == "stop"


def test_token_budget_limits_prefill_batch():
    _, s = make(budget=8)
    a, b = seq("a", 6), seq("b", 6)
    s.add(a), s.add(b)
    assert s.schedule() == [a]


def test_preemption_frees_blocks_and_requeues_for_recompute():
    bm, s = make(num_blocks=2, block_size=4)
    a, b = seq("a", 4), seq("b", 4)
    s.add(a), s.add(b)
    assert s.schedule() == [a, b]
    s.postprocess([a, b], [60, 61])  # both now need a 2nd block; only 0 free
    scheduled = s.schedule()
    assert scheduled == [a]  # b preempted so a can continue
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and s.waiting[0] is b
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
