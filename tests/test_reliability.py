"""A run never dies quietly and never lies: total failure, NaN, resume, locking and
crash-consistency of the trainer."""

import json, math, os, re, subprocess, sys, textwrap, warnings
from pathlib import Path
import pytest, torch

from memagent.config import get_preset
from memagent.data import make_synthetic
from memagent.engines import TransientEngineError
from memagent.health import RunHealthError, NonFiniteError, read_health
from memagent.reward import register_reward, REWARDS
from memagent.trainer import Trainer
from memagent import checkpoint as ckpt
from memagent.checkpoint import RunLockedError, CheckpointError
from memagent.resume import ResumeError
from memagent.report import reward_summary

pytestmark = pytest.mark.timeout(300)

if 'test_parity_length' not in REWARDS:

    @register_reward('test_parity_length')
    def _parity(text, answers):
        return float(len(text) % 2)


@pytest.fixture
def nan_reward():
    """A reward that is NaN for odd-length answers, registered for one test only (other tests check
    every registered reward)."""
    register_reward('test_nan_reward')(lambda text, answers: float('nan') if len(text) % 2 else 1.0)
    yield 'test_nan_reward'
    REWARDS.pop('test_nan_reward', None)


def _cfg(**kw):
    o = {
        'grpo.reward': 'test_parity_length',
        'grpo.group_size': 2,
        'schedule.steps': 3,
        'schedule.save_every': 1,
    }
    o.update(kw)
    return get_preset('tiny', o)


@pytest.fixture(scope='module')
def examples():
    return make_synthetic(4, num_words=40, hops=1, seed=0)


def _trainer(cfg, d, examples, **kw):
    return Trainer(cfg, d, examples, progress=False, tensorboard=False, **kw)


def _steps(d):
    return [
        json.loads(l)['step']
        for l in (Path(d) / 'metrics.jsonl').read_text().splitlines()
        if l.strip()
    ]


class _DeadEngine:
    "Every request fails, as when every SGLang server is down (after the client's own retries)."

    def generate(self, prompts, params, return_exceptions=False):
        errs = [
            TransientEngineError('http://127.0.0.1:1/generate: connection refused') for _ in prompts
        ]
        if not return_exceptions:
            raise errs[0]
        return errs

    weight_sync = 'tensor'

    def sync_weights(self, *a, **k):
        return 0.0

    def release_memory(self):
        pass

    def close(self):
        pass


def test_total_failure_stops_the_run_and_the_report_refuses_it(tmp_path, examples):
    cfg = _cfg(**{'schedule.steps': 6, 'health.max_empty_steps': 2})
    tr = _trainer(cfg, tmp_path, examples, engine=_DeadEngine())
    with pytest.raises(
        RunHealthError,
        match=r'steps 1\.\.2: every trajectory failed in 2 steps in a row.*connection refused',
    ):
        tr.train()
    tr.close()
    h = read_health(tmp_path)
    assert h['status'] == 'stopped' and h['step'] == 2 and 'connection refused' in h['reason']
    assert ckpt.list_checkpoints(tmp_path / 'checkpoints')[-1].name == 'step_000001', (
        'nothing was saved for the failed step'
    )
    with pytest.raises(ValueError, match='stopped unhealthy at step 2'):
        reward_summary(tmp_path)


def test_non_finite_reward_stops_the_step(tmp_path, examples, nan_reward):
    tr = _trainer(_cfg(**{'grpo.reward': nan_reward, 'schedule.steps': 4}), tmp_path, examples)
    with pytest.raises(ValueError, match='without a finite reward'):
        for _ in range(4):
            tr.step()
    tr.close()
    assert read_health(tmp_path)['status'] == 'stopped'


def test_non_finite_loss_stops_before_backward():
    from memagent.colocate import make_group
    from memagent.transfer import InProcessChannel
    from memagent.trajectory import Row

    g = make_group(_cfg(**{'loss.kl_coef': 0.0}), pad_id=0)
    before = {k: v.clone() for k, v in g.hf_state_dict().items()}
    rows = [
        Row(
            'a#0',
            0,
            0,
            1,
            1.0,
            float('nan'),
            float('nan'),
            1.0,
            [1, 2, 3],
            [4, 5],
            [-6.0, -6.0],
            [1, 1],
        )
    ]
    ch = InProcessChannel(2, 1)
    ch.put(1, rows)
    with pytest.raises(
        NonFiniteError,
        match=r"loss of micro-batch 0 of mini-batch 0 \(1 rows, trajectories \['a#0'\]\) is nan",
    ):
        g.update(ch, 1, timeout=5)
    assert all(p.grad is None for p in g.policy.model.parameters()), 'no backward ran'
    assert all(torch.equal(before[k], v) for k, v in g.hf_state_dict().items())


def test_exploding_update_stops_before_any_save(tmp_path, examples):
    cfg = _cfg(**{'optim.name': 'sgd', 'optim.lr': 1e38, 'optim.grad_clip': None})
    tr = _trainer(cfg, tmp_path, examples)
    with pytest.raises(NonFiniteError, match='after the optimizer step|before the optimizer step'):
        tr.train()
    tr.close()
    h = read_health(tmp_path)
    assert h['status'] == 'stopped' and 'NonFiniteError' in h['reason']
    saved = ckpt.list_checkpoints(tmp_path / 'checkpoints')
    assert f"step_{h['step']:06d}" not in [p.name for p in saved], (
        'the step that blew up was never saved'
    )
    for p in saved:
        ckpt.load_checkpoint(p)  # what was saved is finite (loading checks it)
    with pytest.raises(ValueError, match='stopped unhealthy'):
        reward_summary(tmp_path)


def test_nan_checkpoint_is_never_resumed(tmp_path, examples):
    cfg = _cfg(**{'schedule.steps': 2})
    tr = _trainer(cfg, tmp_path, examples)
    tr.train()
    tr.close()
    last = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / 'checkpoints'))
    bad = dict(last['model'])
    k = next(iter(bad))
    bad[k] = bad[k].clone()
    bad[k].view(-1)[0] = float('nan')
    # as an older version would have written it: the manifest is intact
    ckpt.save_checkpoint(
        tmp_path / 'checkpoints',
        2,
        bad,
        last['optimizer'],
        last['state'],
        last['config_yaml'],
        last['provenance'],
        check_finite=False,
    )
    with pytest.warns(UserWarning, match=rf"step_000002.*non-finite tensors \['{k}'\]"):
        again = _trainer(cfg, tmp_path, examples)
    try:
        assert again.step_no == 1, 'falls back to the intact step-1 checkpoint'
    finally:
        again.close()


def test_corrupt_latest_falls_back_and_names_the_file(tmp_path, examples):
    cfg = _cfg(**{'schedule.steps': 2})
    tr = _trainer(cfg, tmp_path, examples)
    tr.train()
    tr.close()
    f = tmp_path / 'checkpoints' / 'step_000002' / 'model.safetensors'
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))
    with pytest.warns(UserWarning, match=r'step_000002/model\.safetensors: SHA-256 differs'):
        again = _trainer(cfg, tmp_path, examples)
    try:
        assert again.step_no == 1 and _steps(tmp_path) == [1]
        assert json.loads((tmp_path / 'run.json').read_text())['skipped_checkpoints'][0].endswith(
            'SHA-256 differs from the manifest (corrupt)'
        )
        assert (tmp_path / 'checkpoints' / 'latest').read_text() == 'step_000001', (
            'latest names the step the metrics now end at'
        )
    finally:
        again.close()


@pytest.mark.parametrize('damage', ['manifest removed', 'latest left behind'])
def test_every_checkpoint_passed_over_is_warned_and_recorded(tmp_path, examples, damage):
    """A step directory without its manifest, `latest` naming it, or a complete checkpoint newer
    than the one `latest` names: each is passed over with a warning naming it, listed in run.json's
    skipped_checkpoints, and `latest` names the step the metrics are trimmed to."""
    cfg = _cfg(**{'schedule.steps': 2})
    tr = _trainer(cfg, tmp_path, examples)
    tr.train()
    tr.close()
    root = tmp_path / 'checkpoints'
    if damage == 'manifest removed':
        (root / 'step_000002' / 'manifest.json').unlink()
        expect = [
            r"step_000002: no manifest\.json",
            r"latest names 'step_000002', which is not a complete checkpoint",
        ]
    else:
        # a save that wrote step 2 and stopped before moving latest
        (root / 'latest').write_text('step_000001')
        expect = [r"step_000002: newer than step_000001, which latest names"]
    with pytest.warns(UserWarning) as caught:
        again = _trainer(cfg, tmp_path, examples)
    try:
        said = ' | '.join(str(w.message) for w in caught)
        assert all(re.search(e, said) for e in expect), said
        skipped = json.loads((tmp_path / 'run.json').read_text())['skipped_checkpoints']
        assert len(skipped) == len(expect) and all(
            re.search(e, x) for e, x in zip(expect, skipped)
        ), skipped
        assert (
            again.step_no == 1
            and _steps(tmp_path) == [1]
            and (root / 'latest').read_text() == 'step_000001'
        )
    finally:
        again.close()


def test_resume_refuses_a_changed_config_unless_allowed(tmp_path, examples):
    tr = _trainer(_cfg(**{'schedule.steps': 1}), tmp_path, examples)
    tr.train()
    tr.close()
    with pytest.raises(ResumeError, match=r"optim\.lr: 0\.0001 in the checkpoint, 0\.001 now"):
        _trainer(_cfg(**{'schedule.steps': 2, 'optim.lr': 1e-3}), tmp_path, examples)
    ok = _trainer(
        _cfg(
            **{
                'schedule.steps': 2,
                'optim.lr': 1e-3,
                'resume_overrides': ['optim.lr', 'schedule.steps'],
            }
        ),
        tmp_path,
        examples,
    )
    try:
        assert ok.step_no == 1
        logged = {
            d['key']: (d['checkpoint'], d['now'])
            for d in json.loads((tmp_path / 'run.json').read_text())['resume_overrides']
        }
        assert logged['optim.lr'] == (1e-4, 1e-3) and logged['schedule.steps'] == (1, 2)
    finally:
        ok.close()


def test_two_trainers_on_one_directory(tmp_path, examples):
    a = _trainer(_cfg(), tmp_path, examples)
    try:
        with pytest.raises(
            RunLockedError, match=rf'another trainer holds this run directory \(pid {os.getpid()}'
        ):
            _trainer(_cfg(), tmp_path, examples)
    finally:
        a.close()
    _trainer(_cfg(), tmp_path, examples).close()  # free once the first is closed


def test_stale_temporary_checkpoint_folders_are_removed(tmp_path, examples):
    (tmp_path / 'checkpoints' / '.tmp-step_000001-dead').mkdir(parents=True)
    tr = _trainer(_cfg(), tmp_path, examples)
    try:
        assert not list((tmp_path / 'checkpoints').glob('.tmp-*'))
    finally:
        tr.close()


CRASH = textwrap.dedent('''
    import os, sys
    from memagent.config import get_preset
    from memagent.data import make_synthetic
    from memagent.reward import register_reward
    from memagent.trainer import Trainer
    from memagent import checkpoint as ckpt
    register_reward('test_parity_length')(lambda text, answers: float(len(text) % 2))
    where, run_dir = sys.argv[1], sys.argv[2]
    cfg = get_preset('tiny', {'grpo.reward': 'test_parity_length', 'grpo.group_size': 2, 'schedule.steps': 3, 'schedule.save_every': 1})
    tr = Trainer(cfg, run_dir, make_synthetic(4, num_words=40, hops=1, seed=0), progress=False, tensorboard=False)
    real_save, real_torch_save = ckpt.save_checkpoint, ckpt.torch.save
    def save(*a, **k):
        if a[1] == 2 and where == 'after_metrics': os._exit(3)          # the step-2 metrics line is written, no checkpoint
        out = real_save(*a, **k)
        if a[1] == 2 and where == 'after_checkpoint': os._exit(3)       # both written
        return out
    def torch_save(obj, f, *a, **k):
        if where == 'during_checkpoint' and 'step_000002' in str(f): os._exit(3)
        return real_torch_save(obj, f, *a, **k)
    ckpt.save_checkpoint, ckpt.torch.save = save, torch_save
    if where == 'torn_metrics':
        real_log = tr._log
        def log(m):
            if m['step'] == 2:
                with open(tr.run_dir / 'metrics.jsonl', 'a') as f: f.write('{"step": 2, "rew'); f.flush()
                os._exit(3)
            real_log(m)
        tr._log = log
    tr.train()
''')  # noqa: E501


@pytest.mark.parametrize(
    'where', ['after_metrics', 'during_checkpoint', 'after_checkpoint', 'torn_metrics']
)
def test_killed_at_each_boundary_resumes_consistently(tmp_path, examples, where):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run(
        [sys.executable, '-c', CRASH, where, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert r.returncode == 3, r.stderr[-3000:]
    resumed_at = 2 if where == 'after_checkpoint' else 1
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        tr = _trainer(_cfg(), tmp_path, examples)
    try:
        assert tr.step_no == resumed_at and _steps(tmp_path) == list(range(1, resumed_at + 1))
        assert (where == 'torn_metrics') == any('torn last line' in str(w.message) for w in ws)
        tr.train()
    finally:
        tr.close()
    assert _steps(tmp_path) == [1, 2, 3] and read_health(tmp_path)['status'] == 'completed'
    s = reward_summary(tmp_path)  # the run still reports, every step exactly once
    assert s['steps'] == 3


@pytest.mark.parametrize(
    'bad',
    [b'[' * 100_000 + b']' * 100_000, b'[1]', '{}'.encode('utf-16')],
    ids=['nesting bomb', 'wrong shape', 'not UTF-8'],
)
def test_an_unreadable_checkpoint_manifest_is_passed_over_and_recorded(tmp_path, examples, bad):
    """The newest checkpoint's manifest.json is bad: resume falls back to the one before, warning
    and recording it (memagent.files reads it)."""
    cfg = _cfg(**{'schedule.steps': 2})
    tr = _trainer(cfg, tmp_path, examples)
    tr.train()
    tr.close()
    mf = tmp_path / 'checkpoints' / 'step_000002' / 'manifest.json'
    mf.write_bytes(bad)
    with pytest.warns(UserWarning) as caught:
        again = _trainer(cfg, tmp_path, examples)
    try:
        said = ' | '.join(str(w.message) for w in caught)
        assert str(mf) in said and 'unreadable manifest' in said, said
        assert any(
            str(mf) in x
            for x in json.loads((tmp_path / 'run.json').read_text())['skipped_checkpoints']
        )
        assert again.step_no == 1
    finally:
        again.close()
