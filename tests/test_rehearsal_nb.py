"""The rehearsal notebook at reduced counts (the variant CI runs): the frozen preset's shapes on TP
2 x DP 2 Ray
ranks, with its row, rank, capacity and plan gates, the checkpoint and export, and the 64-chunk
truncation.
A failed phase stops the later ones (run in this process: the notebook's cells, no kernel)."""

import json, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / 'nbs' / 'rehearsal.ipynb'
REDUCED = dict(
    prompts=2,
    group=8,
    tp=2,
    dp=2,
    train_docs=32,
    eval_items=1,
    eval_docs=50,
    trunc_docs=1000,
    progress=False,
)


def _papermill(tmp_path, run, **params):
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
    ]
    for k, v in params.items():
        args += ['-p', k, str(v)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    return p, tmp_path / 'reports' / run, tmp_path / 'runs' / run


# four or more Ray ranks: the machine's every core, so it runs alone (scripts/test.sh)
@pytest.mark.exclusive
@pytest.mark.timeout(1800)
def test_rehearsal_reduced(tmp_path):
    p, rep, run = _papermill(tmp_path, 'ci', **REDUCED)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    R = json.loads((rep / 'rehearsal.json').read_text())
    gates = {g['gate']: g for g in R['gates']}
    assert R['passed'] and all(g['result'] == 'PASS' for g in R['gates'])
    for s in (1, 2):
        for name in ('rows', 'ranks', 'capacity', 'plan'):
            assert f'{name}[step {s}]' in gates
    # the preset's shapes: 2 x 8 trajectories of 3-chunk documents, one row per turn, split over 2
    # DP ranks
    for st in R['steps']:
        assert (
            st['trajectories'] == 16
            and st['turns_min'] == st['turns_max'] == 4
            and st['rows'] == 64
        )
        assert st['per_rank'] == [32, 32] and st['capacity'] == 16 * 65
        for k in ('micro_batches', 'micro_batches_per_rank', 'tokens_per_rank'):
            assert st['plan'][k] == st[k], k
        assert st['plan']['rows_per_rank'] == st['per_rank']
        # a chunk of 2048 plus template and memory
        assert st['row_tokens_max'] <= 9216 and st['row_tokens_max'] > 2048
    # only the listed overrides differ from the preset, and the truncation item is read to 64 chunks
    # and disclosed
    assert gates['overrides_only']['unlisted'] == []
    t = gates['truncation_disclosed']
    assert (
        t['document_chunks'] > 64
        and t['read_chunks'] == [64]
        and t['truncated'] == [True]
        and t['dropped_tokens'][0] > 0
    )
    ranks = [r for r in R['memory']['processes'] if r['name'] == 'ray::Rank']
    assert R['memory']['peak_total'] > 0 and len(ranks) == 4, R['memory']['by_name']
    readme = (rep / 'README.md').read_text()
    assert (
        'The plan evaluated on the measured rows' in readme
        and '**no**' not in readme
        and 'Time goal' in readme
    )
    times = readme.split('Seconds per trainer phase, per step:', 1)[1].split('\n\n')[1].splitlines()
    assert (
        times[0].startswith('| step |')
        and 'total' in times[0]
        and [l.split('|')[1].strip() for l in times[2:]] == ['1', '2']
    )
    assert (rep / 'rehearsal.png').stat().st_size > 1000
    assert (run / 'checkpoints' / 'step_000002').is_dir() and (run / 'hf' / 'config.json').is_file()


def test_rehearsal_refuses_unknown_parameter(tmp_path):
    p, _, _ = _papermill(tmp_path, 'bad', stepz=2)
    assert p.returncode != 0 and "unknown parameter 'stepz'" in (p.stdout + p.stderr)


def _exec_cells(params):
    """The notebook's cells in this process (memagent.testing.run_notebook_cells): (namespace, the
    exception that ended the run or None)."""
    from memagent.testing import run_notebook_cells

    return run_notebook_cells(NB, params)


def test_rehearsal_a_failed_phase_stops_the_later_phases(tmp_path, monkeypatch):
    """The machine's model cache is a file, not a folder: the data phase fails; each later phase is
    NOT RUN naming it and writes nothing (no run folder, no Ray), the shutdown and the report still
    run, the last cell raises."""
    cache = tmp_path / 'cache'
    cache.write_text('a file where the model cache should be\n')
    monkeypatch.setenv('MEMAGENT_CACHE', str(cache))
    runs, reps = tmp_path / 'runs', tmp_path / 'reports'
    ns, err = _exec_cells(
        {
            'run': 'r',
            'out_dir': str(runs),
            'report_dir': str(reps),
            'timeout_s': 300,
            'progress': False,
        }
    )
    later = ['trainer_init', 'train', 'step_checks', 'checkpoint', 'export', 'eval', 'truncation']
    assert isinstance(err, RuntimeError), repr(err)
    assert (
        "rehearsal r: 1 gate(s) failed: data; phase data failed, so these did not run: "
        f"{', '.join(later)}" in str(err)
    ), str(err)
    R = json.loads((reps / 'r' / 'rehearsal.json').read_text())
    assert not R['passed'] and R['stopped_at'] == 'data'
    by = {g['gate']: g for g in R['gates']}
    assert by['data']['result'] == 'FAIL' and str(cache) in by['data']['error'], by['data']
    assert [g['gate'] for g in R['gates'] if g['result'] == 'NOT RUN'] == later
    assert all(by[n]['reason'] == "phase 'data' failed" and R['phases'][n] is None for n in later)
    assert [g['gate'] for g in R['gates'] if g['result'] == 'FAIL'] == ['data']
    assert by['overrides_only']['result'] == by['wall_clock']['result'] == 'PASS'
    assert (
        R['phases']['shutdown'] is not None
        and ns['trainer'] is None
        and ns['metrics'] == []
        and ns['EVAL'] == {}
    )
    readme = (reps / 'r' / 'README.md').read_text()
    assert (
        f"**FAILED**: 3/{len(R['gates'])} gates passed; failed: data; phase data failed, so these "
        "did not run: " in readme
    ), readme[:2000]
    assert (
        "| train | NOT RUN | reason=phase 'data' failed |" in readme
        and '| eval | not run |' in readme
    )
    assert not runs.exists()  # no later phase wrote into the run folder
    import ray

    assert not ray.is_initialized()  # no Ray ranks started
