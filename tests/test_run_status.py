"""What a run records about itself: its status however short it is, strict JSON metrics, resume with
other data, empty data files, refused resumes."""

import json, subprocess, sys, warnings
from pathlib import Path
import pytest

from memagent.config import get_preset
from memagent.data import DataError, make_synthetic, read_examples, write_examples
from memagent.engines import DeterministicEngineError, engine_from_config
from memagent.health import RunHealthError, read_health
from memagent.resume import ResumeError
from memagent import checkpoint as ckpt

# a dead engine, the tiny config and trainer of the reliability tests
from test_reliability import (
    _DeadEngine,
    _cfg,
    _trainer,
)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope='module')
def examples():
    return make_synthetic(4, num_words=40, hops=1, seed=0)


def _strict(line: str) -> dict:
    "One metrics line parsed as strict JSON (NaN, Infinity refused)."

    def refuse(c):
        raise ValueError(f"not JSON: {c}")

    return json.loads(line, parse_constant=refuse)


def _metrics(d) -> list[dict]:
    return [_strict(l) for l in (Path(d) / 'metrics.jsonl').read_text().splitlines() if l.strip()]


class _OddOnlyEngine:
    """Wraps an engine; in the first call every other request fails, so every group of the step
    loses one trajectory."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def generate(self, prompts, params, return_exceptions=False):
        out = self.inner.generate(prompts, params, return_exceptions=True)
        self.calls += 1
        if self.calls == 1:
            out = [
                DeterministicEngineError('injected: invalid output') if i % 2 == 0 else o
                for i, o in enumerate(out)
            ]
        return out

    weight_sync = property(lambda self: self.inner.weight_sync)

    def sync_weights(self, *a, **kw):
        return self.inner.sync_weights(*a, **kw)

    def release_memory(self):
        self.inner.release_memory()


def test_short_run_where_every_request_failed_stops_naming_the_cause(tmp_path, examples):
    cfg = _cfg(**{'schedule.steps': 2})  # shorter than health.max_empty_steps (3)
    tr = _trainer(cfg, tmp_path, examples, engine=_DeadEngine())
    with pytest.raises(
        RunHealthError,
        match=(
            r'no step of 2 updated the policy: step 1 had no usable trajectory \(4 of 4 failed\); '
            r'first error: .*connection refused'
        ),
    ):
        tr.train()
    tr.close()
    h = read_health(tmp_path)
    assert (h['status'], h['step'], h['trained_steps']) == (
        'stopped',
        2,
        0,
    ) and 'connection refused' in h['reason']
    ms = _metrics(tmp_path)  # strict JSON: reward_mean is null, and the line says why
    assert [m['step'] for m in ms] == [1, 2] and all(m['reward_mean'] is None for m in ms)
    assert ms[0]['null_reasons']['reward_mean'] == 'nan: no usable trajectory (every group dropped)'


def test_every_group_dropped_counts_as_an_empty_step(tmp_path, examples):
    cfg = _cfg(**{'schedule.steps': 1})
    tr = _trainer(cfg, tmp_path, examples, engine=_OddOnlyEngine(engine_from_config(cfg)))
    with pytest.raises(
        RunHealthError,
        match=r'step 1 had no usable trajectory \(2 of 4 failed\); first error: .*injected',
    ):
        tr.train()
    tr.close()
    m = _metrics(tmp_path)[0]
    assert m['dropped_groups'] == 2 and m['failed_trajectories'] == 2 and m['skipped_update']
    assert read_health(tmp_path)['status'] == 'stopped'


def test_health_is_written_after_every_step_and_counts_trained_steps(tmp_path, examples):
    tr = _trainer(_cfg(**{'schedule.steps': 2}), tmp_path, examples)
    try:
        tr.step()  # a run killed here shows step 1, not step 0
        h = read_health(tmp_path)
        assert (h['status'], h['step'], h['trained_steps']) == ('running', 1, 1)
        tr.train()
    finally:
        tr.close()
    h = read_health(tmp_path)
    assert (h['status'], h['step'], h['trained_steps'], h['first_empty_step']) == (
        'completed',
        2,
        2,
        None,
    )
    assert all(
        m['rows_generated'] > 0 and isinstance(m['reward_mean'], float) for m in _metrics(tmp_path)
    )
    again = _trainer(
        _cfg(**{'schedule.steps': 3, 'resume_overrides': ['schedule.steps']}), tmp_path, examples
    )
    try:
        again.train()  # the count travels in the checkpoint
    finally:
        again.close()
    assert (read_health(tmp_path)['status'], read_health(tmp_path)['trained_steps']) == (
        'completed',
        3,
    )


def test_resume_with_other_training_data_is_refused_unless_allowed(tmp_path, examples):
    tr = _trainer(_cfg(**{'schedule.steps': 1}), tmp_path, examples)
    tr.train()
    tr.close()
    # same count, same config, other examples
    other = make_synthetic(4, num_words=40, hops=1, seed=1)
    with pytest.raises(
        ResumeError,
        match=(
            r"data\.train \(sha256 of the training examples\): '[0-9a-f]{64}' in the checkpoint, "
            r"'[0-9a-f]{64}' now"
        ),
    ):
        _trainer(
            _cfg(**{'schedule.steps': 2, 'resume_overrides': ['schedule.steps']}), tmp_path, other
        )
    ok = _trainer(
        _cfg(**{'schedule.steps': 2, 'resume_overrides': ['schedule.steps', 'data.train']}),
        tmp_path,
        other,
    )
    try:
        assert ok.step_no == 1
        logged = {
            d['key']: (d['checkpoint'], d['now'])
            for d in json.loads((tmp_path / 'run.json').read_text())['resume_overrides']
        }
        old, new = logged['data.train (sha256 of the training examples)']
        assert old != new and new == ok.prov['data_sha256']
    finally:
        ok.close()


@pytest.mark.parametrize('text', ['', '\n  \n'])
def test_empty_data_file_is_a_data_error_naming_it(tmp_path, text):
    p = tmp_path / 'empty.jsonl'
    p.write_text(text)
    with pytest.raises(
        DataError, match=r'empty\.jsonl: no examples: the file is empty or holds only blank lines'
    ):
        read_examples(p)
    r = subprocess.run(
        [
            sys.executable,
            '-c',
            'import sys; from memagent.evaluate import evaluate_cli; '
            'sys.exit(evaluate_cli(sys.argv[1:]))',
            '--model',
            'tiny-qwen3',
            '--data',
            str(p),
            '--out',
            str(tmp_path / 'eval'),
            '--no-progress',
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert r.returncode == 2 and f'{p}: no examples' in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / 'eval').exists()


@pytest.mark.timeout(400)
def test_train_notebook_refuses_an_empty_data_file_before_writing_data(tmp_path):
    p = tmp_path / 'empty.jsonl'
    p.write_text('\n')
    cmd = [
        sys.executable,
        '-m',
        'papermill',
        str(ROOT / 'nbs' / 'train.ipynb'),
        str(tmp_path / 'o.ipynb'),
        '--cwd',
        str(tmp_path),
        '-p',
        'preset',
        'tiny',
        '-p',
        'steps',
        '1',
        '-p',
        'run',
        'ci',
        '-p',
        'train_data',
        str(p),
        '-p',
        'out_dir',
        str(tmp_path / 'runs'),
        '-p',
        'report_dir',
        str(tmp_path / 'reports'),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=360)
    out = r.stderr + r.stdout
    assert r.returncode != 0 and 'DataError' in out and f'{p}: no examples' in out, out[-3000:]
    assert not (tmp_path / 'runs' / 'ci' / 'data').exists(), (
        'the data folder is written only from examples that were read'
    )


def _relayout(d):
    """Re-save the latest checkpoint with its optimizer shard under another rank's key (as another
    parallel layout writes it)."""
    last = ckpt.load_checkpoint(ckpt.latest_checkpoint(Path(d) / 'checkpoints'))
    opt = {'shards': {f'other-{k}': v for k, v in last['optimizer']['shards'].items()}}
    ckpt.save_checkpoint(
        Path(d) / 'checkpoints',
        last['state']['step'],
        last['model'],
        opt,
        last['state'],
        last['config_yaml'],
        last['provenance'],
    )


def _tear_middle(d):
    p = Path(d) / 'metrics.jsonl'
    lines = p.read_text().splitlines()
    p.write_text('\n'.join([lines[0][:10], *lines[1:]]) + '\n')


@pytest.mark.parametrize(
    'damage,needle',
    [(_relayout, 'another parallel layout'), (_tear_middle, 'metrics.jsonl:1: not valid JSON')],
)
def test_refused_resume_writes_nothing(tmp_path, examples, damage, needle):
    tr = _trainer(_cfg(**{'schedule.steps': 2}), tmp_path, examples)
    tr.train()
    tr.close()
    damage(tmp_path)
    before = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in tmp_path.rglob('*')
        if p.is_file() and p.name != '.lock'
    }
    # an allowed change: config.yaml and run.json would differ if written
    with pytest.raises(ValueError, match=needle):
        _trainer(
            _cfg(**{'schedule.steps': 3, 'resume_overrides': ['schedule.steps']}),
            tmp_path,
            examples,
        )
    after = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in tmp_path.rglob('*')
        if p.is_file() and p.name != '.lock'
    }
    assert set(after) == set(before) and [k for k in before if before[k] != after[k]] == []


class _DiesAfterFirstStep:
    """Wraps an engine; once `dead` is set every request fails, as when the policy a step left gives
    nothing usable."""

    def __init__(self, inner):
        self.inner, self.dead = inner, False

    def generate(self, prompts, params, return_exceptions=False):
        if self.dead:
            return _DeadEngine().generate(prompts, params, return_exceptions=return_exceptions)
        return self.inner.generate(prompts, params, return_exceptions=return_exceptions)

    weight_sync = property(lambda self: self.inner.weight_sync)

    def sync_weights(self, *a, **kw):
        return self.inner.sync_weights(*a, **kw)

    def release_memory(self):
        self.inner.release_memory()


def test_a_run_whose_last_step_had_no_usable_trajectory_is_not_completed(tmp_path, examples):
    """Step 1 trains; step 2, the last, has no usable trajectory: the run ends `stopped`, not
    `completed`, naming the steps."""
    cfg = _cfg(**{'schedule.steps': 2})
    eng = _DiesAfterFirstStep(engine_from_config(cfg))
    tr = _trainer(cfg, tmp_path, examples, engine=eng)
    try:
        tr.step()
        eng.dead = True
        with pytest.raises(
            RunHealthError,
            match=(
                r'steps 2\.\.2, the last 1 of 2, had no usable trajectory \(4 of 4 failed in step '
                r'2\).*first error: .*connection refused'
            ),
        ):
            tr.train()
    finally:
        tr.close()
    h = read_health(tmp_path)
    assert (h['status'], h['step'], h['trained_steps'], h['first_empty_step']['step']) == (
        'stopped',
        2,
        1,
        2,
    ), h
    assert [m['step'] for m in _metrics(tmp_path)] == [1, 2]
