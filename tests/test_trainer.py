"Trainer: exact resume, crash during save, replay, Ray data parallel, export."

import json, math, os
from pathlib import Path
import pytest, torch

from memagent.config import get_preset
from memagent.data import make_synthetic
from memagent.reward import register_reward, REWARDS
from memagent.trainer import Trainer
from memagent import checkpoint as ckpt

pytestmark = pytest.mark.timeout(300)

if 'test_odd_length' not in REWARDS:

    @register_reward('test_odd_length')
    def _odd(text, answers):
        """A reward with variance for a random model: 1 when the final response has an odd number of
        characters."""
        return float(len(text) % 2)


def _cfg(**kw):
    o = {
        'grpo.reward': 'test_odd_length',
        'grpo.group_size': 4,
        'schedule.steps': 3,
        'schedule.save_every': 1,
        'optim.lr': 1e-3,
    }
    o.update(kw)
    return get_preset('tiny', o)


@pytest.fixture(scope='module')
def examples():
    return make_synthetic(4, num_words=40, hops=1, seed=0)


def _weights(tr):
    return {k: v.clone() for k, v in tr.group.hf_state_dict().items()}


def _close(a, b, atol=1e-6):
    return all(torch.allclose(a[k].float(), b[k].float(), atol=atol) for k in a)


# SGD: Adam's first step is ~lr*sign(g), so float noise in near-zero gradients would flip whole
# updates.
SGD = {'schedule.steps': 1, 'optim.name': 'sgd', 'optim.lr': 0.1}


@pytest.fixture(scope='module')
def reference(tmp_path_factory, examples):
    """One online single-process SGD step on the torch backend: what replay, Ray DP and megatron
    runs must reproduce."""
    d = tmp_path_factory.mktemp('reference')
    tr = Trainer(_cfg(**SGD), d, examples, progress=False, tensorboard=False)
    m = tr.train()[0]
    assert m['grad_norm'] > 0
    return {'metrics': m, 'weights': _weights(tr), 'rollouts': d / 'rollouts'}


def _replayed(tmp_path, examples, reference, name, world_size=1, **overrides):
    "A trainer on the reference run's rollout dumps, so it sees exactly the reference rows."
    return Trainer(
        _cfg(**SGD, **overrides),
        tmp_path / name,
        examples,
        progress=False,
        tensorboard=False,
        world_size=world_size,
        replay_dir=reference['rollouts'],
    )


def test_micro_batches_respect_the_budget_as_padded(reference):
    """What the ranks ran (reported by the trainer) fits the budget as right-padded, and the fill is
    of those micro-batches."""
    m, budget = reference['metrics'], _cfg(**SGD).batch.max_tokens_per_micro
    assert m['micro_batches'] > 1, (
        'the budget must force several micro-batches for this test to mean anything'
    )
    assert 0 < m['max_padded_tokens'] <= budget
    assert m['micro_batches'] >= math.ceil(m['tokens'] / budget)
    assert math.isclose(m['packing_fill'], m['tokens'] / (m['micro_batches'] * budget))


def test_resume_is_exact(tmp_path, examples):
    cfg = _cfg(**{'schedule.steps': 2})
    full = Trainer(cfg, tmp_path / 'full', examples, progress=False, tensorboard=False)
    mf = full.train()
    assert any(m['zero_variance_groups'] < m['trajectories'] // 4 for m in mf), (
        'the test reward must have variance'
    )
    assert mf[0]['grad_norm'] > 0
    part = Trainer(cfg, tmp_path / 'part', examples, progress=False, tensorboard=False)
    part.train(1)
    part.close()
    resumed = Trainer(cfg, tmp_path / 'part', examples, progress=False, tensorboard=False)
    assert resumed.step_no == 1
    m2 = resumed.train()[-1]
    for k in ('reward_mean', 'loss', 'grad_norm', 'rows_generated', 'kl'):
        assert math.isclose(m2[k], mf[1][k], rel_tol=1e-5, abs_tol=1e-7), (k, m2[k], mf[1][k])
    assert _close(_weights(resumed), _weights(full))
    steps = [
        json.loads(l)['step']
        for l in (tmp_path / 'part' / 'metrics.jsonl').read_text().splitlines()
    ]
    assert steps == [1, 2]


def test_crash_during_save_keeps_previous(tmp_path, examples, monkeypatch):
    cfg = _cfg()
    tr = Trainer(cfg, tmp_path, examples, progress=False, tensorboard=False)
    tr.train(1)
    before = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / 'checkpoints'))

    def crash(*a, **k):
        raise RuntimeError('injected failure after writing the model')

    with monkeypatch.context() as mp:  # the model file is written, then the next file fails
        mp.setattr(ckpt.torch, 'save', crash)
        with pytest.raises(RuntimeError, match='injected'):
            tr.step()
    assert ckpt.latest_checkpoint(tmp_path / 'checkpoints').name == 'step_000001'
    assert not [p for p in (tmp_path / 'checkpoints').iterdir() if p.name.startswith('.tmp')]
    tr.close()
    again = Trainer(cfg, tmp_path, examples, progress=False, tensorboard=False)
    assert again.step_no == 1
    assert _close(_weights(again), before['model'], atol=0)


def test_replay_matches_online_and_ray_dp(tmp_path, examples, reference):
    m_on, w_on = reference['metrics'], reference['weights']
    replay = _replayed(tmp_path, examples, reference, 'replay')
    m_re = replay.train()[0]
    assert m_re['rows_consumed'] == m_on['rows_consumed']
    assert _close(_weights(replay), w_on, atol=1e-7)
    dp = _replayed(tmp_path, examples, reference, 'dp', world_size=2)
    try:
        m_dp = dp.train()[0]
        assert (
            len(m_dp['rows_consumed_per_rank']) == 2
            and len(set(m_dp['rows_consumed_per_rank'])) == 1
        )
        assert (
            m_dp['rows_consumed']
            == m_dp['rows_generated'] + m_dp['rows_padding']
            == m_dp['rows_transferred']
        )
        assert math.isclose(m_dp['loss'], m_on['loss'], rel_tol=1e-4, abs_tol=1e-7)
        assert m_dp['max_padded_tokens'] <= _cfg(**SGD).batch.max_tokens_per_micro
        assert _close(_weights(dp), w_on, atol=1e-6), (
            'summed DP gradients must equal the single-process step'
        )
    finally:
        dp.close()


def test_export_reloads_and_generates(tmp_path, examples):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tr = Trainer(
        _cfg(**{'schedule.steps': 1}), tmp_path, examples, progress=False, tensorboard=False
    )
    tr.train()
    p = tr.export(tmp_path / 'hf')
    m, tok = AutoModelForCausalLM.from_pretrained(p), AutoTokenizer.from_pretrained(p)
    ids = tok('hello', return_tensors='pt').input_ids
    out = m.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3
    assert _close({k: v for k, v in m.state_dict().items()}, _weights(tr), atol=0)
    assert json.loads((p / 'memagent_provenance.json').read_text())['step'] == 1


def test_megatron_backend_trains_like_torch(tmp_path, examples, reference):
    pytest.importorskip('megatron.core')
    m_t = reference['metrics']
    meg = _replayed(tmp_path, examples, reference, 'meg', backend='megatron')
    try:
        m_m = meg.train()[0]
        assert math.isclose(m_m['loss'], m_t['loss'], rel_tol=1e-4, abs_tol=1e-6)
        assert math.isclose(m_m['grad_norm'], m_t['grad_norm'], rel_tol=1e-3)
        assert _close(_weights(meg), reference['weights'], atol=1e-5), (
            'one GRPO step moves both backends alike'
        )
        p = meg.export(tmp_path / 'hf')
        from transformers import AutoModelForCausalLM

        assert _close(AutoModelForCausalLM.from_pretrained(p).state_dict(), _weights(meg), atol=0)
    finally:
        from memagent.backends.megatron import destroy_parallel

        destroy_parallel()


class _FlakyEngine:
    """Wraps an engine; the first request of the first call fails deterministically (after the
    engine's own retries)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def generate(self, prompts, params, return_exceptions=False):
        from memagent.engines import DeterministicEngineError

        out = self.inner.generate(prompts, params, return_exceptions=True)
        self.calls += 1
        if self.calls == 1:
            out[0] = DeterministicEngineError('injected: invalid output')
        return out

    weight_sync = property(lambda self: self.inner.weight_sync)

    def sync_weights(self, *a, **kw):
        return self.inner.sync_weights(*a, **kw)

    def release_memory(self):
        self.inner.release_memory()


def test_failed_trajectory_drops_its_whole_group(tmp_path, examples):
    from memagent.engines import engine_from_config

    cfg = _cfg(**{'schedule.steps': 1})
    eng = _FlakyEngine(engine_from_config(cfg))
    tr = Trainer(cfg, tmp_path, examples, engine=eng, progress=False, tensorboard=False)
    m = tr.train()[0]
    assert (m['failed_trajectories'], m['dropped_groups']) == (1, 1)
    dump = [json.loads(l) for l in open(tmp_path / 'rollouts' / 'step_000001.jsonl')]
    assert len(dump) == cfg.trajectories_per_step, (
        'the dump keeps every trajectory, failed ones included'
    )
    bad = {t['group_index'] for t in dump if t['error']}
    kept = [t for t in dump if t['group_index'] not in bad]
    assert m['rows_generated'] == sum(len(t['turns']) for t in kept) == m['rows_consumed']


def test_megatron_tensor_parallel_trains_like_torch(tmp_path, examples, reference):
    pytest.importorskip('megatron.core')
    m_t = reference['metrics']
    tp = _replayed(
        tmp_path,
        examples,
        reference,
        'tp',
        world_size=2,
        **{'backend': 'megatron', 'batch.n_gpus': 2, 'batch.tp': 2},
    )
    try:
        # state_key = TP rank
        layout = sorted((l['state_key'], l['dp_rank'], l['row_source']) for l in tp.group.layouts)
        assert layout == [(0, 0, True), (1, 0, False)]
        m = tp.train()[0]
        assert (
            m['rows_consumed_per_rank'] == [m['rows_consumed']]
            and m['rows_consumed'] == m_t['rows_consumed']
        )
        assert math.isclose(m['loss'], m_t['loss'], rel_tol=1e-4, abs_tol=1e-6)
        assert math.isclose(m['grad_norm'], m_t['grad_norm'], rel_tol=1e-3)
        assert _close(_weights(tp), reference['weights'], atol=1e-5), (
            'TP 2 step must match the single-process torch step'
        )
        ck = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / 'tp' / 'checkpoints'))
        assert sorted(ck['optimizer']['shards']) == [0, 1], (
            'one optimizer shard per tensor-parallel rank'
        )
    finally:
        tp.close()


# four or more Ray ranks: the machine's every core, so it runs alone (scripts/test.sh)
@pytest.mark.exclusive
def test_megatron_tp2_dp2_trains_like_torch(tmp_path, examples, reference):
    "Four ranks: two replicas of a TP-2 model, each taking half of the step's rows."
    pytest.importorskip('megatron.core')
    m_t = reference['metrics']
    run = _replayed(
        tmp_path,
        examples,
        reference,
        'tpdp',
        world_size=4,
        **{'backend': 'megatron', 'batch.n_gpus': 4, 'batch.tp': 2},
    )
    try:
        m = run.train()[0]
        assert len(m['rows_consumed_per_rank']) == 2 and len(set(m['rows_consumed_per_rank'])) == 1
        assert m['rows_consumed'] == m_t['rows_consumed'] + m['rows_padding']
        assert math.isclose(m['loss'], m_t['loss'], rel_tol=1e-4, abs_tol=1e-6)
        assert _close(_weights(run), reference['weights'], atol=1e-5)
        ck = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / 'tpdp' / 'checkpoints'))
        assert sorted(ck['optimizer']['shards']) == [0, 1], (
            'data-parallel replicas share a shard; tensor-parallel ranks do not'
        )
    finally:
        run.close()
    again = _replayed(
        tmp_path,
        examples,
        reference,
        'tpdp',
        world_size=4,
        **{'backend': 'megatron', 'batch.n_gpus': 4, 'batch.tp': 2},
    )
    try:
        assert again.step_no == 1 and _close(_weights(again), ck['model'], atol=0), (
            'each rank resumes its own shard'
        )
    finally:
        again.close()
