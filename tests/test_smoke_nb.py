"""The smoke notebook end to end through papermill on the tiny preset: it passes with agreeing row
counts for
both steps and the engine holding the trainer's weights after every sync, and a failing gate (the
`inject_failure='rows'` and `'weights'` hooks) makes papermill exit non-zero after the report is
written.
A failed phase stops the later ones (run in this process: the notebook's cells, no kernel)."""

import json, re, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / 'nbs' / 'smoke.ipynb'


def _papermill(tmp_path, run, **params):
    """Run the notebook with papermill's command line; returns (completed process, report dir, run
    dir)."""
    pytest.importorskip('papermill')
    args = [
        sys.executable,
        '-m',
        'papermill',
        str(NB),
        str(tmp_path / f'{run}.ipynb'),
        '--cwd',
        str(ROOT),
        '--no-progress-bar',
        '-k',
        'python3',
        '-p',
        'run',
        run,
        '-p',
        'out_dir',
        str(tmp_path / 'runs'),
        '-p',
        'report_dir',
        str(tmp_path / 'reports'),
        '-p',
        'timeout_s',
        '300',
    ]
    for k, v in params.items():
        args += ['-p', k, str(v)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=400)
    return p, tmp_path / 'reports' / run, tmp_path / 'runs' / run


def _step_rows(readme: str) -> list[list[str]]:
    "The data lines of the 'Row counts per step' table, as cells."
    sec = readme.split('## Row counts per step', 1)[1].split('\n## ', 1)[0]
    lines = [l for l in sec.splitlines() if l.startswith('|')]
    head = [c.strip() for c in lines[0].strip('|').split('|')]
    assert head[:6] == [
        'step',
        'rows_generated',
        'rows_padding',
        'rows_transferred',
        'rows_consumed',
        'rows_consumed_per_rank',
    ]
    return [[c.strip() for c in l.strip('|').split('|')] for l in lines[2:]]


def _check_counts(readme: str, world: int):
    rows = _step_rows(readme)
    assert [r[0] for r in rows] == ['1', '2']
    for r in rows:
        g, p, t, c = map(int, r[1:5])
        per = json.loads(r[5])
        assert g > 0 and g + p == t == c, r
        assert len(per) == world and len(set(per)) == 1 and sum(per) == c, r


@pytest.mark.timeout(300)
def test_smoke_tiny_passes(tmp_path):
    p, rep, run = _papermill(tmp_path, 'tiny')
    assert p.returncode == 0, p.stderr[-3000:]
    readme = (rep / 'README.md').read_text()
    assert (
        '**PASSED**' in readme
        and 'device: CPU' in readme
        and 'model: tiny-qwen3' in readme
        and 'engine: hf' in readme
    )
    _check_counts(readme, world=1)
    gates = json.loads((rep / 'gates.json').read_text())
    assert gates['passed'] and {g['gate'] for g in gates['gates']} >= {
        'train',
        'steps_completed',
        'rows[step 1]',
        'rows[step 2]',
        'ranks[step 1]',
        'no_failed_requests',
        'checkpoint_saved',
        'checkpoint_loads',
        'export_reloads',
        'eval_request',
        'weights_synced[step 0]',
        'weights_synced[step 1]',
        'weights_synced[step 2]',
        'kl[step 1]',
    }
    assert all(g['result'] == 'PASS' for g in gates['gates'])
    by = {g['gate']: g for g in gates['gates']}
    # after every sync (and before training) the engine serves the trainer's weights
    for s in (
        0,
        1,
        2,
    ):
        w = by[f'weights_synced[step {s}]']
        assert (
            w['tol'] == 1e-5
            and 0.0 <= w['max_abs_dlogp'] <= 1e-5
            and w['servers'] == 1
            and w['prompt_tokens'] >= 8
        ), w
        assert s == 0 or w['stale_servers'] == []
    assert by['kl[step 1]']['kl'] == 0.0 and by['kl[step 1]']['precision'] == 'cpu-fp32'
    wc = gates['weight_check']
    assert (
        wc['precision'] == 'cpu-fp32'
        and wc['tol'] == 1e-5
        and len(wc['prompt_ids']) == by['weights_synced[step 0]']['prompt_tokens']
    )
    assert '## Weight check' in readme and wc['prompt'] in readme
    assert (rep / 'phase_times.png').stat().st_size > 1000
    assert (run / 'checkpoints' / 'step_000002').is_dir() and (run / 'hf' / 'config.json').is_file()
    assert (run / 'eval' / 'records.jsonl').read_text().count('\n') == 1
    # a timing row for step 2
    assert re.search(r'\| 2 \| [\d.]+ \|', readme.split('## Timings', 1)[1])


@pytest.mark.timeout(300)
def test_smoke_failing_gate_fails_papermill(tmp_path):
    # one step is enough to fail
    p, rep, _ = _papermill(tmp_path, 'bad', inject_failure='rows', steps=1)
    assert p.returncode != 0
    assert 'gate(s) failed: rows[step 1]' in p.stdout + p.stderr
    # the report is still written, and names the failure
    readme = (rep / 'README.md').read_text()
    assert (
        '**FAILED**' in readme
        and '| rows[step 1] | **FAIL** |' in readme
        and '| checkpoint_loads | PASS |' in readme
    )
    gates = json.loads((rep / 'gates.json').read_text())
    # consumed no longer matches transferred, nor the per-rank sum: exactly those two gates fail
    assert not gates['passed'] and [g['gate'] for g in gates['gates'] if g['result'] == 'FAIL'] == [
        'rows[step 1]',
        'ranks[step 1]',
    ]


@pytest.mark.timeout(300)
def test_smoke_engine_off_the_trainers_weights_fails(tmp_path):
    # every sync delivers the trainer's weights plus noise: the sync returns fine, only the weight
    # gate sees it
    p, rep, _ = _papermill(tmp_path, 'stale', inject_failure='weights', steps=1)
    assert p.returncode != 0 and 'gate(s) failed: weights_synced[step 1]' in p.stdout + p.stderr
    gates = json.loads((rep / 'gates.json').read_text())
    assert [g['gate'] for g in gates['gates'] if g['result'] == 'FAIL'] == [
        'weights_synced[step 1]'
    ]
    by = {g['gate']: g for g in gates['gates']}
    assert (
        by['weights_synced[step 0]']['max_abs_dlogp']
        <= 1e-5
        < by['weights_synced[step 1]']['max_abs_dlogp']
    )
    assert '| weights_synced[step 1] | **FAIL** |' in (rep / 'README.md').read_text()


@pytest.mark.timeout(300)
def test_smoke_bad_parameter_is_refused(tmp_path):
    p, rep, _ = _papermill(tmp_path, 'param', engine='vllm')
    assert p.returncode != 0 and "parameter engine='vllm'" in p.stdout + p.stderr
    assert not rep.exists()


@pytest.mark.timeout(400)
def test_smoke_two_ranks_ray(tmp_path):
    pytest.importorskip('ray')
    p, rep, _ = _papermill(tmp_path, 'dp2', world_size=2)
    assert p.returncode == 0, p.stderr[-3000:]
    readme = (rep / 'README.md').read_text()
    assert '**PASSED**' in readme and 'world size: 2' in readme
    _check_counts(readme, world=2)


@pytest.mark.timeout(300)
def test_smoke_wall_clock_guard(tmp_path):
    # a guard far shorter than the run: the running phase fails with a message naming it, papermill
    # exits non-zero
    p, rep, _ = _papermill(tmp_path, 'guard', timeout_s=6)
    assert p.returncode != 0 and 'wall_clock' in p.stdout + p.stderr
    gates = {g['gate']: g for g in json.loads((rep / 'gates.json').read_text())['gates']}
    assert gates['wall_clock']['result'] == 'FAIL'
    assert any('wall-clock guard' in str(g.get('error', '')) for g in gates.values())


def _exec_cells(params):
    """The notebook's cells in this process (memagent.testing.run_notebook_cells): (namespace, the
    exception that ended the run or None)."""
    from memagent.testing import run_notebook_cells

    return run_notebook_cells(NB, params)


def test_smoke_a_failed_phase_stops_the_later_phases(tmp_path, monkeypatch):
    """The machine's model cache is a file, not a folder: setup fails; each later phase is NOT RUN
    naming it and writes nothing, the shutdown and the report still run, the last cell raises."""
    cache = tmp_path / 'cache'
    cache.write_text('a file where the model cache should be\n')
    monkeypatch.setenv('MEMAGENT_CACHE', str(cache))
    runs, reps = tmp_path / 'runs', tmp_path / 'reports'
    _, err = _exec_cells(
        {'run': 'r', 'out_dir': str(runs), 'report_dir': str(reps), 'timeout_s': 300}
    )
    later = ['trainer_init', 'train', 'step_checks', 'checkpoint', 'export', 'eval']
    assert isinstance(err, RuntimeError), repr(err)
    assert (
        "smoke r: 1 gate(s) failed: setup; phase setup failed, so these did not run: "
        f"{', '.join(later)}" in str(err)
    ), str(err)
    gates = json.loads((reps / 'r' / 'gates.json').read_text())
    assert not gates['passed'] and gates['stopped_at'] == 'setup'
    by = {g['gate']: g for g in gates['gates']}
    assert by['setup']['result'] == 'FAIL' and str(cache) in by['setup']['error'], by['setup']
    assert [g['gate'] for g in gates['gates'] if g['result'] == 'NOT RUN'] == later
    assert all(
        by[n]['reason'] == "phase 'setup' failed" and gates['phases'][n] is None for n in later
    )
    assert [g['gate'] for g in gates['gates'] if g['result'] == 'FAIL'] == ['setup'] and by[
        'wall_clock'
    ]['result'] == 'PASS'
    assert gates['phases']['shutdown'] is not None  # the shutdown still ran
    readme = (reps / 'r' / 'README.md').read_text()
    assert (
        '**FAILED**: 1/8 gates passed; failed: setup; phase setup failed, so these did not run: '
        in readme
    ), readme[:2000]
    assert (
        '| train | NOT RUN | reason=phase \'setup\' failed |' in readme
        and '| eval | not run |' in readme
    )
    assert not runs.exists()  # no later phase wrote into the run folder
