"""Reward summary of a run directory: refusals, hand-worked numbers, files written, and the console
script."""

import configparser, csv, json, math, os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from memagent.report import reward_summary, summary_cli, md_table, window_stats, SUMMARY_FILES

pytestmark = pytest.mark.timeout(90)


def make_run(d, rewards, steps=None, planned=None, pass_rates=None, lines=None):
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    steps = steps or list(range(1, len(rewards) + 1))
    pass_rates = pass_rates or rewards
    if lines is None:
        lines = [
            json.dumps(
                {
                    'step': s,
                    'reward_mean': r,
                    'pass_rate': p,
                    'rows': 10,
                    'kl': 0.0,
                    'entropy': 1.2,
                    'grad_norm': 0.3,
                    'clip_frac': 0.0,
                    'time_rollout_s': 2.0,
                    'memory_lengths': [1, 2],
                }
            )
            for s, r, p in zip(steps, rewards, pass_rates)
        ]
    (d / 'metrics.jsonl').write_text('\n'.join(lines) + '\n')
    (d / 'run.json').write_text(
        json.dumps(
            {
                'steps': planned or len(rewards),
                'config': {'seed': 0},
                'provenance': {'git': {'commit': 'c0ffee', 'dirty': False}},
            }
        )
    )
    return d


# hand-worked: rewards over 10 steps, window 3
REWARDS = [0.0, 0.125, 0.25, 0.25, 0.5, 0.375, 0.75, 0.625, 0.75, 0.5]
# first window: (0 + .125 + .25)/3 = .125 ; last window: (.625 + .75 + .5)/3 = .625 ; delta .5 ;
# peak .75 first at step 7


def test_summary_numbers(tmp_path):
    run = make_run(tmp_path / 'r', REWARDS, pass_rates=[0.0] * 5 + [1.0] * 5)
    s = reward_summary(run, window=3)
    assert s['first_window_mean'] == pytest.approx(0.125)
    assert s['last_window_mean'] == pytest.approx(0.625)
    assert s['delta'] == pytest.approx(0.5)
    assert (s['peak'], s['peak_step']) == (0.75, 7)
    assert (s['steps'], s['window'], s['expected_steps_source']) == (10, 3, 'run.json')
    assert s['mean_all'] == pytest.approx(sum(REWARDS) / 10)
    assert (s['pass_rate_first_window'], s['pass_rate_last_window']) == (0.0, 1.0)
    on_disk = json.loads((run / 'reward_summary.json').read_text())
    assert on_disk['delta'] == pytest.approx(0.5)
    assert on_disk['run_provenance'] == {'git': {'commit': 'c0ffee', 'dirty': False}}
    assert (
        set(on_disk['provenance']['inputs']) == {'metrics.jsonl', 'run.json'}
        and 'git' in on_disk['provenance']
    )
    rows = list(csv.DictReader(open(run / 'reward_by_step.csv')))
    assert [int(r['step']) for r in rows] == list(range(1, 11))
    assert [float(r['reward_mean']) for r in rows] == REWARDS
    assert (
        list(rows[0])[:3] == ['step', 'reward_mean', 'pass_rate']
        and 'kl' in rows[0]
        and 'memory_lengths' not in rows[0]
    )
    assert (run / 'reward_curve.png').read_bytes()[:4] == b'\x89PNG'


def test_window_longer_than_run_and_out_of_order(tmp_path):
    lines = [
        json.dumps({'step': s, 'reward_mean': r, 'pass_rate': r})
        for s, r in [(3, 0.5), (1, 0.0), (2, 1.0)]
    ]
    s = reward_summary(
        make_run(tmp_path / 'r', [0] * 3, lines=lines), window=5, out_dir=tmp_path / 'out'
    )
    assert s['window_used'] == 3 and s['first_window_mean'] == s[
        'last_window_mean'
    ] == pytest.approx(0.5)
    assert (s['peak'], s['peak_step'], s['delta']) == (1.0, 2, 0.0)
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == sorted(SUMMARY_FILES)


def test_peak_ties_take_first_step():
    assert window_stats([1, 2, 3, 4], [0.2, 0.9, 0.1, 0.9], window=1)['peak_step'] == 2


@pytest.mark.parametrize(
    'kind,kwargs,msg',
    [
        (
            'incomplete',
            dict(rewards=[0.1, 0.2, 0.3], planned=5),
            'incomplete run: 2 of 5 steps missing (4, 5)',
        ),
        (
            'duplicate',
            dict(rewards=[0.1, 0.2, 0.3], steps=[1, 2, 2], planned=3),
            "metrics.jsonl: line 3: field 'step': duplicate step 2 (first at line 2)",
        ),
        (
            'out_of_range_high',
            dict(rewards=[0.1, 0.2], steps=[1, 3], planned=2),
            "metrics.jsonl: line 2: field 'step': step 3 out of range 1..2",
        ),
        (
            'out_of_range_zero',
            dict(rewards=[0.1, 0.2], steps=[0, 1], planned=2),
            "metrics.jsonl: line 1: field 'step': step 0 out of range 1..2",
        ),
        (
            'nan',
            dict(rewards=[0.1, float('nan')]),
            "metrics.jsonl: line 2: field 'reward_mean': is not finite",
        ),
        (
            'inf',
            dict(rewards=[float('inf'), 0.1]),
            "metrics.jsonl: line 1: field 'reward_mean': is not finite",
        ),
        (
            'missing_field',
            dict(rewards=[0], lines=['{"step": 1, "pass_rate": 0.5}']),
            "metrics.jsonl: line 1: missing field(s) ['reward_mean']",
        ),
        (
            'bad_json',
            dict(rewards=[0], lines=['{"step": 1, "reward_mean": 0.1, "pass_rate": 0.1}', '{oops']),
            'metrics.jsonl: line 2: not valid JSON',
        ),
        (
            'string_reward',
            dict(rewards=[0], lines=['{"step": 1, "reward_mean": "0.5", "pass_rate": 0.5}']),
            "field 'reward_mean': must be a number",
        ),
        (
            'float_step',
            dict(rewards=[0], lines=['{"step": 1.0, "reward_mean": 0.5, "pass_rate": 0.5}']),
            "field 'step': expected a whole number, got float",
        ),
    ],
)
def test_refusals(tmp_path, kind, kwargs, msg):
    run = make_run(tmp_path / kind, **kwargs)
    with pytest.raises(ValueError) as e:
        reward_summary(run)
    assert msg in str(e.value)
    assert str(run / 'metrics.jsonl') in str(e.value)
    assert not (run / 'reward_summary.json').exists()


def test_expected_steps_argument_and_run_json(tmp_path):
    run = make_run(tmp_path / 'r', [0.1, 0.2, 0.3], planned=4)
    with pytest.raises(ValueError, match='incomplete run'):
        reward_summary(run)
    assert reward_summary(run, expected_steps=3)['expected_steps_source'] == 'argument'
    with pytest.raises(ValueError, match='out of range 1..2'):
        reward_summary(run, expected_steps=2)
    (run / 'run.json').unlink()
    with pytest.raises(ValueError, match='run.json not found'):
        reward_summary(run)
    (run / 'run.json').write_text('{"steps": 0, "config": {}, "provenance": {}}')
    with pytest.raises(ValueError, match="'steps' must be a positive integer"):
        reward_summary(run)
    (run / 'run.json').write_text('{"steps": 3}')
    with pytest.raises(ValueError, match=r"run.json: field 'config': missing: not a run"):
        reward_summary(run)


def _cli(*args):
    "Run the console script if installed, else the same entry point through the interpreter."
    exe = Path(sys.executable).with_name('memagent-reward-summary')
    cmd = (
        [str(exe)]
        if exe.exists()
        else [sys.executable, '-c', 'from memagent.report import summary_cli; summary_cli()']
    )
    env = {**os.environ, 'PYTHONPATH': str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', '')}
    # a hang guard: a busy neighbour may slow the imports, never forever
    return subprocess.run(
        cmd + [str(a) for a in args], capture_output=True, text=True, env=env, timeout=600
    )


def test_cli_exit_codes(tmp_path):
    good = make_run(tmp_path / 'good', REWARDS)
    r = _cli(good, '--window', 3)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[0])
    assert out['delta'] == pytest.approx(0.5) and out['peak_step'] == 7
    assert (good / 'reward_summary.json').exists()
    bad = make_run(tmp_path / 'bad', [0.1, 0.2], planned=3)
    r = _cli(bad)
    assert r.returncode == 2 and 'incomplete run: 1 of 3 steps missing (3)' in r.stderr
    r = _cli(good, '--expected-steps', 12)
    assert r.returncode == 2 and 'incomplete run' in r.stderr


def test_cli_declared_in_settings():
    cp = configparser.ConfigParser()
    cp.read(ROOT / 'settings.ini')
    assert (
        'memagent-reward-summary=memagent.report:summary_cli'
        in cp['DEFAULT']['console_scripts'].split()
    )
    assert summary_cli.__module__ == 'memagent.report'


def test_md_table_columns_and_format():
    t = md_table([{'a': 1, 'b': 0.12345}, {'a': 2, 'c': 'x'}], floatfmt='.2f')
    assert t.splitlines() == ['| a | b | c |', '|---:|---:|---|', '| 1 | 0.12 |  |', '| 2 |  | x |']


def test_committed_reports_need_a_clean_tree(tmp_path):
    import subprocess
    from memagent.report import write_report
    from memagent.provenance import changed_source_files, git_state

    git = lambda *a: subprocess.run(
        ['git', '-C', str(tmp_path), *a], check=True, capture_output=True
    )
    git('init', '-q')
    git('config', 'user.email', 'r@example.invalid')
    git('config', 'user.name', 'r')
    (tmp_path / 'code.py').write_text('x = 1\n')
    (tmp_path / 'reports').mkdir()
    (tmp_path / 'reports' / 'old.md').write_text('old\n')
    git('add', '.')
    git('commit', '-qm', 'init')
    assert changed_source_files(tmp_path) == []
    # the run's own outputs do not count
    (tmp_path / 'reports' / 'old.md').write_text('re-rendered\n')
    assert git_state(tmp_path)['dirty'] is False
    write_report(tmp_path / 'reports' / 'run', 'clean', [('a', 'b')])
    (tmp_path / 'code.py').write_text('x = 2\n')
    assert changed_source_files(tmp_path) == ['code.py'] and git_state(tmp_path)['changed'] == [
        'code.py'
    ]
    with pytest.raises(ValueError, match=r"code\.py"):
        write_report(tmp_path / 'reports' / 'run2', 'dirty', [('a', 'b')])
    assert not (tmp_path / 'reports' / 'run2').exists()
    # outside reports/: not checked
    write_report(tmp_path / 'elsewhere', 'not a committed report', [('a', 'b')])
