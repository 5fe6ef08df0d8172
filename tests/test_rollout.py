"""The recurrent rollout: step-synchronous batching, memory bound, alignment, seeds, failures,
weight updates, log-probs."""

import pytest, torch
from memagent.config import get_preset
from memagent.engines import (
    HFEngine,
    SGLangEngine,
    GenerationResult,
    SamplingParams,
    DeterministicEngineError,
    TransientEngineError,
)
from memagent.testing import FakeSGLangServer, fake_tokens
from memagent.models import load_model, load_tokenizer
from memagent import prompts as P
from memagent.chunking import chunk_document
from memagent.rollout import rollout, stop_token_ids, request_seed, logprob_agreement
from memagent.bench import bench_rollout

torch.set_num_threads(1)
WORDS = "the lamp stood near a quiet garden road while evening wind moved over old stone".split()
LONG = ' '.join(WORDS[i % len(WORDS)] for i in range(70)) + ' The code of the tower is 7890.'
EXAMPLES = [
    dict(id='long', question='What is the code of the tower?', context=LONG, answers=['7890']),
    dict(
        id='short',
        question='Where did the lamp stand?',
        context='The lamp stood near a quiet garden.',
        answers=['garden'],
    ),
]


@pytest.fixture(scope='module')
def tok():
    return load_tokenizer('tiny-qwen3')


@pytest.fixture(scope='module')
def model():
    return load_model('tiny-qwen3')


@pytest.fixture(scope='module')
def cfg():
    c = get_preset('tiny')
    assert (c.chunking.chunk_tokens, c.chunking.memory_tokens, c.chunking.final_tokens) == (
        32,
        16,
        8,
    )
    return c


class FakeEngine:
    """Deterministic fake: hashed tokens from a word-piece range; optional stop after `stop_at`
    tokens; records batches."""

    def __init__(self, stop_at=None, lo=1000, hi=20000):
        self.batches, self.params, self.prompts, self.stop_at, self.lo, self.hi = (
            [],
            [],
            [],
            stop_at,
            lo,
            hi,
        )
        self.stats = {'requests': 0}

    def generate(self, prompts, params, return_exceptions=False):
        self.batches.append(len(prompts))
        self.params.append(params)
        self.prompts.append(prompts)
        out = []
        for p, sp in zip(prompts, params):
            ids, lps, fr = fake_tokens(p, sp, self.hi - self.lo)
            ids = [self.lo + t for t in ids]
            if self.stop_at is not None and sp.max_new_tokens > self.stop_at:
                ids, lps, fr = (
                    ids[: self.stop_at] + [sp.stop_token_ids[0]],
                    lps[: self.stop_at + 1],
                    'stop',
                )
            out.append(GenerationResult(ids, lps, fr, len(p), 0.0))
        return out


def test_step_synchronous_batching(tok, cfg):
    eng = FakeEngine()
    st = {}
    trajs = rollout(EXAMPLES, eng, tok, cfg, group_size=1, progress=False, stats=st)
    assert [t.num_chunks for t in trajs] == [3, 1]
    assert eng.batches == [2, 1, 1, 2]
    assert st['memory_batches'] == [2, 1, 1] and st['final_batch'] == 2 and st['requests'] == 6
    assert [p.max_new_tokens for p in eng.params[0]] == [16, 16] and [
        p.max_new_tokens for p in eng.params[-1]
    ] == [8, 8]
    assert all(t.ok and t.validate() for t in trajs)
    assert [[u.turn_index for u in t.turns] for t in trajs] == [[0, 1, 2, 3], [0, 1]]


def test_group_layout_and_ids(tok, cfg):
    trajs = rollout(EXAMPLES, FakeEngine(), tok, cfg, group_size=2, progress=False, group_offset=4)
    assert [t.traj_id for t in trajs] == ['long#0', 'long#1', 'short#0', 'short#1']
    assert [t.group_index for t in trajs] == [4, 4, 5, 5] and [t.sample_index for t in trajs] == [
        0,
        1,
        0,
        1,
    ]


def test_memory_overwrite_bound_and_final_prompt(tok, cfg):
    eng = FakeEngine()
    t = rollout(EXAMPLES[:1], eng, tok, cfg, group_size=1, progress=False)[0]
    assert P.NO_MEMORY in tok.decode(t.turns[0].prompt_ids)
    texts = chunk_document(LONG, tok, 32, 3).texts
    for k in range(1, 3):  # turn k sees exactly: question + memory written at turn k-1 + chunk k
        prev = P.memory_from_response(
            tok.decode(t.turns[k - 1].response_ids, skip_special_tokens=True), tok, 16, 'off'
        )[0]
        assert t.turns[k].prompt_ids == P.encode_user(
            tok, P.memory_prompt(t.question, prev, texts[k], 'train'), 'off'
        )
        assert P.NO_MEMORY not in tok.decode(t.turns[k].prompt_ids)
    for n in t.memory_lengths:
        assert n <= cfg.chunking.memory_tokens
    assert t.turns[-1].memory_tokens == t.memory_lengths[-1]
    final = tok.decode(t.turns[-1].prompt_ids)
    assert 'tower is 7890' not in final and 'quiet garden road' not in final and t.question in final
    last_mem = P.memory_from_response(
        tok.decode(t.turns[2].response_ids, skip_special_tokens=True), tok, 16, 'off'
    )[0]
    assert t.turns[-1].prompt_ids == P.encode_user(
        tok, P.final_prompt(t.question, last_mem, 'train'), 'off'
    )


def test_memory_bound_on_expanding_text(tok, cfg):
    # decoded random pieces often re-encode to MORE tokens than were sampled: the bound must still
    # hold
    eng = FakeEngine(lo=0, hi=150000)
    for t in rollout(EXAMPLES, eng, tok, cfg, group_size=4, progress=False):
        assert t.ok and all(n <= 16 for n in t.memory_lengths)


def test_alignment_and_stop_tokens(tok, cfg):
    eng = FakeEngine(stop_at=2)
    stops = stop_token_ids(tok)
    assert tok.convert_tokens_to_ids('<|im_end|>') in stops
    for t in rollout(EXAMPLES, eng, tok, cfg, group_size=1, progress=False):
        for u in t.turns:
            assert len(u.response_ids) == len(u.rollout_logprobs) == len(u.loss_mask) == 3 and set(
                u.loss_mask
            ) == {1}
            assert u.response_ids[-1] in stops and u.finish_reason == 'stop'
    assert all(set(p.stop_token_ids) == set(stops) for ps in eng.params for p in ps)


def test_stop_tokens_end_hf_responses(tok, model, cfg):
    stops = set(stop_token_ids(tok))
    for t in rollout(EXAMPLES, HFEngine(model, tok), tok, cfg, group_size=2, progress=False):
        for u in t.turns:
            assert not (stops & set(u.response_ids[:-1]))
            assert (u.finish_reason == 'stop') == (u.response_ids[-1] in stops)


def test_seeds_reproduce(tok, model, cfg):
    toks = lambda ts: [[u.response_ids for u in t.turns] for t in ts]
    a = rollout(EXAMPLES, HFEngine(model, tok), tok, cfg, group_size=2, seed=3, progress=False)
    b = rollout(EXAMPLES, HFEngine(model, tok), tok, cfg, group_size=2, seed=3, progress=False)
    c = rollout(EXAMPLES, HFEngine(model, tok), tok, cfg, group_size=2, seed=4, progress=False)
    assert toks(a) == toks(b) and toks(a) != toks(c)
    alone = rollout(
        EXAMPLES[1:], HFEngine(model, tok), tok, cfg, group_size=2, seed=3, progress=False
    )
    assert toks(alone) == toks(a[2:])  # batch composition does not change a seeded trajectory
    eng = FakeEngine()
    rollout(EXAMPLES[:1], eng, tok, cfg, group_size=1, seed=9, progress=False)
    assert [ps[0].seed for ps in eng.params] == [request_seed(9, 'long', 0, k) for k in range(4)]


def test_sampling_override(tok, cfg):
    eng = FakeEngine()
    t = rollout(
        EXAMPLES[1:],
        eng,
        tok,
        cfg,
        group_size=1,
        progress=False,
        sampling=dict(temperature=0.7, top_p=0.95),
    )[0]
    assert all(p.temperature == 0.7 and p.top_p == 0.95 for ps in eng.params for p in ps)
    assert t.meta['sampling'] == {'temperature': 0.7, 'top_p': 0.95, 'top_k': cfg.rollout.top_k}
    with pytest.raises(ValueError, match='unknown sampling'):
        rollout(EXAMPLES, eng, tok, cfg, group_size=1, progress=False, sampling=dict(temp=1))


def test_transient_failures_retried_by_sglang_client(tok, cfg):
    with FakeSGLangServer(vocab=20000) as srv:
        cl = SGLangEngine([srv.url], timeout_s=5, max_retries=3, backoff_s=0.01, concurrency=1)
        srv.faults = [500, 'abort', 503]  # three failures of the first request, then success
        st = {}
        trajs = rollout(EXAMPLES, cl, tok, cfg, group_size=1, progress=False, stats=st)
        assert all(t.ok for t in trajs) and cl.stats['retries'] == 3 and st['failed'] == 0
        cl.close()


def test_failing_request_fails_only_its_trajectory(tok, cfg):
    with FakeSGLangServer(vocab=20000) as srv:
        cl = SGLangEngine([srv.url], timeout_s=5, max_retries=1, backoff_s=0.01, concurrency=1)
        srv.faults = [400]  # the first request of step 0: long#0's memory turn
        st = {}
        trajs = rollout(EXAMPLES, cl, tok, cfg, group_size=1, progress=False, stats=st)
        assert [t.ok for t in trajs] == [False, True] and st['failed'] == 1
        assert (
            trajs[0].error.startswith('turn 0 (memory): DeterministicEngineError')
            and trajs[0].turns == []
        )
        assert (
            trajs[0].meta['error_kind'] == 'deterministic'
            and st['memory_batches'] == [2]
            and st['final_batch'] == 1
        )
        srv.faults = [500, 500]  # retries exhausted -> transient failure of that trajectory
        trajs = rollout(EXAMPLES, cl, tok, cfg, group_size=1, progress=False)
        assert [t.ok for t in trajs] == [False, True] and trajs[0].meta['error_kind'] == 'transient'
        cl.close()


def test_whole_batch_failure_of_in_process_engine(tok, model, cfg):
    class Broken(HFEngine):
        calls = 0

        def _generate_batch(self, prompts, params):
            Broken.calls += 1
            if Broken.calls == 2:
                raise RuntimeError('kernel failed')
            return super()._generate_batch(prompts, params)

    trajs = rollout(EXAMPLES, Broken(model, tok), tok, cfg, group_size=1, progress=False)
    # step 0 succeeded for both; step 1 (only 'long') failed; 'short' went on to its final answer
    assert [t.ok for t in trajs] == [False, True] and 'turn 1 (memory)' in trajs[0].error

    class Raising:
        stats = {}

        def generate(self, prompts, params, return_exceptions=False):
            raise TransientEngineError('all servers down')

    trajs = rollout(EXAMPLES, Raising(), tok, cfg, group_size=1, progress=False)
    assert not any(t.ok for t in trajs) and all('all servers down' in t.error for t in trajs)


def test_weight_update_changes_outputs(tok, cfg):
    m = load_model('tiny-qwen3')
    eng = HFEngine(m, tok)
    toks = lambda ts: [[u.response_ids for u in t.turns] for t in ts]
    before = toks(rollout(EXAMPLES, eng, tok, cfg, group_size=1, seed=0, progress=False))
    g = torch.Generator().manual_seed(0)
    eng.update_weights(
        state_dict={
            k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in m.state_dict().items()
        }
    )
    after = toks(rollout(EXAMPLES, eng, tok, cfg, group_size=1, seed=0, progress=False))
    assert after != before


def test_logprob_agreement_and_bench(tok, model, cfg):
    trajs = rollout(EXAMPLES, HFEngine(model, tok), tok, cfg, group_size=2, progress=False)
    a = logprob_agreement(model, trajs)
    assert a['tokens'] > 0 and a['max_abs_diff'] < 1e-4, a
    hot = rollout(
        EXAMPLES,
        HFEngine(model, tok),
        tok,
        cfg,
        group_size=1,
        progress=False,
        sampling=dict(temperature=0.7, top_p=0.9),
    )
    assert logprob_agreement(HFEngine(model, tok), hot)['max_abs_diff'] < 1e-4
    b = bench_rollout(HFEngine(model, tok), tok, cfg, n_traj=3)
    assert (
        b['n_traj'] == 3
        and b['failed'] == 0
        and b['batched_tokens_per_s'] > 0
        and b['sequential_tokens_per_s'] > 0
    )
