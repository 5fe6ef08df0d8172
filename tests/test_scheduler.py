"""The rollout schedulers: sync and async give the same records; failures stay local; concurrency is
bounded; nothing waits forever."""

import threading, time
import pytest
from memagent.config import get_preset, apply_overrides
from memagent.engines import (
    SGLangEngine,
    GenerationResult,
    SamplingParams,
    DeterministicEngineError,
    FutureQueue,
)
from memagent.testing import FakeSGLangServer, fake_tokens
from memagent.models import load_tokenizer
from memagent.rollout import rollout, request_seed, choose_scheduler, RolloutTimeoutError
from memagent.simulate import SimEngine, LENGTHS, synthetic_trajectories, makespan

WORDS = "the lamp stood near a quiet garden road while evening wind moved over old stone".split()


def doc(n):
    return ' '.join(WORDS[i % len(WORDS)] for i in range(n))


EXAMPLES = [
    dict(id=f'x{i}', question='Where is the lamp?', context=doc(8 + 22 * i), answers=['garden'])
    for i in range(5)
]


@pytest.fixture(scope='module')
def tok():
    return load_tokenizer('tiny-qwen3')


def cfg_for(scheduler, **kw):
    return apply_overrides(get_preset('tiny'), {'rollout.scheduler': scheduler, **kw})


def sim(tok, **kw):
    kw = {
        'servers': 2,
        'limit': 6,
        'length': LENGTHS['mixed'],
        'token_pool': tok.encode(' garden lamp stone road'),
        'stop_id': tok.convert_tokens_to_ids('<|im_end|>'),
        **kw,
    }
    return SimEngine(**kw)


def run(tok, scheduler, engine, **kw):
    groups, st = [], {}

    def on_group(ts):
        # finished: answered or failed
        assert all(not t.ok or (t.turns and t.turns[-1].kind == 'final') for t in ts)
        groups.append([t.traj_id for t in ts])
        clocks.append(getattr(engine, 'clock', None))

    clocks = []
    trajs = rollout(
        EXAMPLES,
        engine,
        tok,
        cfg_for(scheduler),
        group_size=3,
        seed=kw.pop('seed', 7),
        progress=False,
        stats=st,
        on_group=on_group,
        **kw,
    )
    st['group_clocks'] = clocks
    return trajs, groups, st


@pytest.mark.parametrize('length', ['short', 'long'])
def test_sync_and_async_give_identical_records(tok, length):
    s_trajs, s_groups, s_st = run(tok, 'sync', sim(tok, length=LENGTHS[length]))
    a_eng = sim(tok, length=LENGTHS[length])
    a_trajs, a_groups, a_st = run(tok, 'async', a_eng)
    assert [t.to_dict() for t in s_trajs] == [t.to_dict() for t in a_trajs]
    assert len({t.num_chunks for t in s_trajs}) > 1 and all(t.ok for t in s_trajs)
    for k in ('memory_batches', 'final_batch', 'requests', 'prompt_tokens', 'generated_tokens'):
        assert s_st[k] == a_st[k], k
    assert (s_st['scheduler'], a_st['scheduler']) == ('sync', 'async')
    # every group reported once, complete; sync in group order, async as groups finish (the
    # one-chunk example first)
    assert s_groups == [[f'x{i}#{s}' for s in range(3)] for i in range(5)]
    assert sorted(a_groups) == sorted(s_groups) and a_groups[0] == ['x0#0', 'x0#1', 'x0#2']
    assert (
        len(set(s_st['group_clocks'])) == 1
        and a_st['group_clocks'][0] < a_st['group_clocks'][-1] == a_eng.clock
    )
    # the bound is per server: 2 servers x 6; 15 trajectories never have more than one request each
    # in flight
    assert (
        3 <= a_st['max_in_flight'] <= 12
        and a_eng.max_in_flight <= 12
        and max(a_eng.peak_on_server) <= 6
    )


def test_async_is_never_slower_on_the_toy_workloads():
    for name in LENGTHS:
        for seed in range(3):
            tr = lambda: synthetic_trajectories(4, 4, (3, 8), chunk_tokens=512, seed=seed)
            eng = lambda: SimEngine(servers=2, limit=8, length=LENGTHS[name])
            a, s = makespan('async', tr, eng, 4), makespan('sync', tr, eng, 4)
            assert a['seconds'] <= s['seconds'] * 1.0001, (name, seed, a, s)
            assert (a['requests'], a['generated_tokens']) == (s['requests'], s['generated_tokens'])
            assert a['max_in_flight'] <= 16 and a['max_in_flight_per_server'] <= 8


@pytest.mark.parametrize('scheduler', ['sync', 'async'])
def test_a_failed_request_fails_only_its_trajectory(tok, scheduler):
    bad = request_seed(7, 'x3', 1, 1)
    fail = lambda prompt, sp: (
        DeterministicEngineError('HTTP 400: refused') if sp.seed == bad else None
    )
    trajs, groups, st = run(tok, scheduler, sim(tok, fail=fail))
    assert [t.traj_id for t in trajs if not t.ok] == ['x3#1'] and st['failed'] == 1
    assert (
        trajs[10].error.startswith('turn 1 (memory): DeterministicEngineError')
        and len(trajs[10].turns) == 1
    )
    ref, _, _ = run(tok, 'sync', sim(tok))
    assert [t.to_dict() for t in trajs if t.ok] == [t.to_dict() for t in ref if t.traj_id != 'x3#1']
    assert (
        len(groups) == 5
        # the group of the failed trajectory is reported too: the trainer drops it, evaluation
        # scores 0
    )


def test_a_request_that_never_answers_times_out(tok):
    hung = request_seed(7, 'x2', 0, 1)
    eng = sim(tok, hang={hung}, wait_limit_s=30.0)
    trajs, groups, st = run(tok, 'async', eng)
    bad = [t for t in trajs if not t.ok]
    assert [t.traj_id for t in bad] == [
        'x2#0'
    ] and 'RolloutTimeoutError: no answer within 30s' in bad[0].error
    assert bad[0].meta['error_kind'] == 'transient' and len(groups) == 5 and eng.in_flight == 0


def test_future_queue_wait_limit_in_real_time():
    "A thread that never returns: the scheduler stops waiting for it after the queue's wait limit."
    from concurrent.futures import ThreadPoolExecutor
    from memagent.rollout import run_async, FINAL

    release = threading.Event()

    def call(prompt, sp):
        if sp.seed == 1:
            release.wait(30)
        return GenerationResult([5], [-1.0], 'length', len(prompt), 0.0)

    pool = ThreadPoolExecutor(4)
    q = FutureQueue(pool, call, limit=4, wait_limit_s=0.5)

    class Walk:  # two one-turn trajectories: the first hangs
        def __init__(self):
            self.trajs, self.out = (
                [type('T', (), {'num_chunks': 0, 'turns': [], 'ok': True})() for _ in range(2)],
                {},
            )

        def __len__(self):
            return 2

        def group_of(self, j):
            return j

        def turns_left(self, j):
            return 1  # one turn each

        def next_request(self, j):
            return None if j in self.out else (FINAL, [1, 2], SamplingParams(1, seed=j + 1))

        def feed(self, j, p, r):
            self.out[j] = r

    w = Walk()
    t0 = time.monotonic()
    run_async(w, q)
    # the hung call would hold it 30 s; a busy machine still finishes in time
    assert time.monotonic() - t0 < 15
    assert isinstance(w.out[0], RolloutTimeoutError) and isinstance(w.out[1], GenerationResult)
    release.set()
    pool.shutdown()


class Counting:
    "An engine behind the fake server: counts the requests it serves at once."

    def __init__(self, delay=0.05):
        self.now = self.peak = 0
        self.lock, self.delay = threading.Lock(), delay

    def generate(self, prompts, sp):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(self.delay)
        with self.lock:
            self.now -= 1
        ids, lps, fr = fake_tokens(prompts[0], sp, 50)
        return [GenerationResult(ids, lps, fr, len(prompts[0]), 0.0)]


def test_sglang_client_async_bounds_concurrency_and_matches_sync(tok):
    counting = Counting()
    with FakeSGLangServer(engine=counting) as srv:
        cl = SGLangEngine([srv.url], timeout_s=10, max_retries=1, backoff_s=0.01, concurrency=3)
        assert choose_scheduler(cl, cfg_for('auto')) == 'async'
        a, _, a_st = run(tok, 'async', cl)
        assert counting.peak <= 3 and a_st['max_in_flight'] == 3
        s, _, _ = run(tok, 'sync', cl)
        assert [t.to_dict() for t in a] == [t.to_dict() for t in s]
        assert cl.stats['requests'] == 2 * a_st['requests']
        cl.close()


def test_sglang_client_bounds_concurrency_per_server(tok):
    """Two servers at concurrency 2: each serves at most 2 generation requests at once, both are
    used, 4 run together."""
    a, b = Counting(delay=0.1), Counting(delay=0.1)
    with FakeSGLangServer(engine=a) as s1, FakeSGLangServer(engine=b) as s2:
        cl = SGLangEngine(
            [s1.url, s2.url], timeout_s=10, max_retries=1, backoff_s=0.01, concurrency=2
        )
        assert cl.request_queue().limit == 4
        trajs, _, st = run(tok, 'async', cl)
        assert all(t.ok for t in trajs) and st['max_in_flight'] == 4
        assert a.peak <= 2 and b.peak <= 2 and a.peak + b.peak >= 3
        assert max(cl.peak_inflight.values()) == 2 and min(cl.peak_inflight.values()) >= 1
        cl.peak_inflight = dict.fromkeys(cl.peak_inflight, 0)
        # the sync path: same bound
        out = cl.generate([[1, 2, 3]] * 10, SamplingParams(4, seed=1), return_exceptions=True)
        assert all(isinstance(r, GenerationResult) for r in out) and set(
            cl.peak_inflight.values()
        ) == {2}
        cl.close()
    with pytest.raises(ValueError, match='concurrency must be an int >= 1'):
        SGLangEngine(['http://127.0.0.1:1'], concurrency=0)


def test_scheduler_choice():
    class Batches:
        def generate(self, prompts, params, return_exceptions=False):
            return []

    assert choose_scheduler(Batches(), cfg_for('auto')) == 'sync'
    assert choose_scheduler(Batches(), cfg_for('sync')) == 'sync'
    with pytest.raises(
        ValueError, match="rollout.scheduler='async' needs an engine with request_queue"
    ):
        choose_scheduler(Batches(), cfg_for('async'))
    assert choose_scheduler(SimEngine(), cfg_for('auto')) == 'async'
    with pytest.raises(ValueError, match='rollout.scheduler'):
        get_preset('tiny', {'rollout.scheduler': 'eager'})


@pytest.mark.timeout(300)
def test_simulation_notebook_renders_its_report(tmp_path):
    """nbs/simulate.ipynb through papermill with tiny counts: the report holds the ratios, the
    latency model and the verdict."""
    import json, subprocess, sys
    from pathlib import Path

    pytest.importorskip('papermill')
    root = Path(__file__).resolve().parent.parent
    cmd = [
        sys.executable,
        '-m',
        'papermill',
        str(root / 'nbs' / 'simulate.ipynb'),
        str(tmp_path / 'o.ipynb'),
        '--cwd',
        str(root),
        '--no-progress-bar',
        '-k',
        'python3',
        '-y',
        'seeds: [0]',
        '-p',
        'eval_items',
        '8',
        '-p',
        'train_groups',
        '2',
        '-p',
        'sensitivity',
        'False',
        '-p',
        'run',
        'tiny',
        '-p',
        'out_root',
        str(tmp_path),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    res = json.loads((tmp_path / 'tiny' / 'results.json').read_text())
    assert (
        len(res['runs']) == 3
        and res['latency_model']['base_s'] > 0
        and 'commit' in json.dumps(res['provenance'])
    )
    for run in res['runs']:
        assert (
            run['train_chain_s'] <= run['train_async']['seconds']
            and run['eval_chain_s'] <= run['eval_async']['seconds']
        )
    text = (tmp_path / 'tiny' / 'README.md').read_text()
    for head in (
        '## Verdict',
        '## The latency model',
        '## What bounds the gain',
        'step sync/async',
        'ratio.png',
    ):
        assert head in text, head
