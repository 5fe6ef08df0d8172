"""The trainer with a colocated engine: every update happens between a release and the resumes of
the weight sync,
and no generate request reaches a server while its memory is released (checked on the SGLang schema
server)."""

import pytest
from memagent.config import get_preset
from memagent.data import make_synthetic
from memagent.engines import SGLangEngine, HFEngine
from memagent.models import load_model, load_tokenizer
from memagent.testing import FakeSGLangServer, schema_error
from memagent.trainer import Trainer

pytestmark = pytest.mark.timeout(600)


def test_trainer_releases_before_the_update_and_resumes_in_the_sync(tmp_path):
    cfg = get_preset(
        'tiny',
        {
            'rollout.engine': 'sglang',
            'rollout.colocate': True,
            'rollout.gpus_per_engine': 1,
            'batch.n_gpus': 1,
            'schedule.steps': 2,
            'schedule.save_every': 2,
            'grpo.reward': 'boxed_em',
        },
    )
    tok = load_tokenizer('tiny-qwen3')
    with FakeSGLangServer(engine=HFEngine(load_model('tiny-qwen3'), tok)) as srv:
        eng = SGLangEngine([srv.url], timeout_s=60, max_retries=1, backoff_s=0.01, colocated=True)
        tr = Trainer(
            cfg,
            tmp_path / 'run',
            make_synthetic(4, num_words=40, seed=0),
            tokenizer=tok,
            engine=eng,
            progress=False,
            tensorboard=False,
        )
        try:
            ms = tr.train()
        finally:
            tr.close()
            eng.close()
        paths = [e['path'] for e in srv.log]
        bodies = [e['body'] for e in srv.log]
    assert [m['rows_consumed'] for m in ms] == [m['rows_transferred'] for m in ms] and all(
        m['rows_consumed'] > 0 for m in ms
    )
    cycle = [
        '/release_memory_occupation',
        '/resume_memory_occupation',
        '/update_weights_from_disk',
        '/resume_memory_occupation',
        '/flush_cache',
    ]
    starts = [i for i, p in enumerate(paths) if p == '/release_memory_occupation']
    assert len(starts) == 2, paths  # one release per step, before its update
    for i in starts:
        assert paths[i : i + 5] == cycle, paths[i : i + 6]
        assert bodies[i + 1] == {'tags': ['weights']} and bodies[i + 3] == {
            'tags': ['kv_cache', 'cuda_graph']
        }
    # rollouts before, and again after the sync
    assert paths[0] == '/generate' and paths[starts[0] + 5] == '/generate'
    released = False  # no generate between a release and the KV resume
    for p, b in zip(paths, bodies):
        if p == '/release_memory_occupation':
            released = True
        elif p == '/resume_memory_occupation' and 'kv_cache' in b['tags']:
            released = False
        elif p == '/generate':
            assert not released, 'a generate request reached a released server'
        assert schema_error(p, b) is None, (p, b)


def test_a_failed_setup_releases_what_it_built(tmp_path, monkeypatch):
    """An engine that fails to launch (after the ranks exist) leaves no lock, and the group is
    closed: a new Trainer starts."""
    import memagent.trainer as T
    from memagent.policy import LocalGroup

    closed = []
    monkeypatch.setattr(LocalGroup, 'close', lambda self: closed.append(self))

    def fail(*a, **k):
        raise RuntimeError('engine launch failed')

    monkeypatch.setattr(T, 'trainer_engine', fail)
    cfg, exs = get_preset('tiny'), make_synthetic(2, num_words=30, seed=0)
    with pytest.raises(RuntimeError, match='engine launch failed'):
        Trainer(cfg, tmp_path / 'run', exs, progress=False, tensorboard=False)
    assert len(closed) == 1
    monkeypatch.undo()
    Trainer(cfg, tmp_path / 'run', exs, progress=False, tensorboard=False).close()
