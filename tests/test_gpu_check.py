"""scripts/gpu_check.sh on a machine without a GPU: --dry-run shows every command, the layouts (and
their refusals) and the
plans; a real run refuses naming the memagent-doctor rows; the layout is never downgraded without
--reduced."""

import ast, json, os, shutil, subprocess, sys
from pathlib import Path
import pytest, yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, 'PYTHON': sys.executable}


def _run(*args):
    return subprocess.run(
        ['bash', 'scripts/gpu_check.sh', *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _py(*args):
    return subprocess.run(
        [sys.executable, 'scripts/gpu_check.py', *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _gpu_check():
    import memagent.gpucheck.layout as layout

    return layout


def _no_te():
    from memagent.backends.megatron import have_transformer_engine

    if have_transformer_engine():
        pytest.skip('Transformer Engine is installed here: the layout needs no reduction')


@pytest.fixture(scope='module')
def dry_run(tmp_path_factory):
    """One `gpu_check.sh --dry-run` for the tests that read its output: (completed process, its
    --out directory)."""
    out = tmp_path_factory.mktemp('dry') / 'gpu'
    return _run('--dry-run', '--out', str(out)), out


def _dry_run_commands(gpu):
    "The commands a dry run with `--out gpu` prints (it runs none of them)."
    return [
        f"{sys.executable} scripts/gpu_check.py subset --out {gpu}/subset",
        f"+ {sys.executable} -m papermill nbs/smoke.ipynb {gpu}/smoke.ipynb -f "
        f"{gpu}/smoke_params.yaml",
        f"scripts/gpu_check.py compare --params {gpu}/smoke_params.yaml --gpus 8",
    ]


# the two tests read one dry run, so they run on one pytest-xdist worker
@pytest.mark.xdist_group('gpu_check_dry_run')
def test_dry_run_prints_every_command_and_the_plans(dry_run):
    r, gpu = dry_run
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for cmd in _dry_run_commands(gpu):
        assert cmd in out, cmd
    # the subset's plan and the cluster's
    assert out.count('plan of ') == 2 and out.count('GiB per GPU') == 2
    assert 'subset: layout: as_configured' in out and 'cluster: layout: as_configured' in out
    assert not gpu.exists()  # a dry run writes nothing


@pytest.mark.xdist_group('gpu_check_dry_run')
def test_a_dry_run_prints_the_refusal_and_exits_0(dry_run):
    import torch

    if torch.cuda.is_available():
        pytest.skip('a GPU machine may not refuse')
    r, _ = dry_run
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        'gpu_check: refused, not downgraded: gpu_check part cluster' in r.stderr
        and 'GPU count: found' in r.stderr
    )
    assert 'part cluster refused (above); a real run stops here, this dry run goes on' in r.stdout


def test_smoke_parameters_are_the_smoke_notebooks(tmp_path):
    p = _gpu_check().smoke_params('none', 8)
    nb = json.loads((ROOT / 'nbs' / 'smoke.ipynb').read_text())
    cell = next(c for c in nb['cells'] if 'parameters' in c.get('metadata', {}).get('tags', []))
    names = {
        n.target.id for n in ast.parse(''.join(cell['source'])).body if isinstance(n, ast.AnnAssign)
    }
    assert set(p) <= names, set(p) - names
    from memagent.config import get_preset

    cfg = get_preset(p['preset'], p['overrides'])  # the overrides validate
    assert cfg.rollout.colocate and cfg.batch.n_gpus == 8 and cfg.backend == 'megatron'
    assert yaml.safe_load(yaml.safe_dump(p)) == p


def test_the_frozen_layout_is_refused_not_downgraded_without_te():
    _no_te()
    gc = _gpu_check()
    p = gc.smoke_params('none', 8)  # the layout as configured, whatever is installed
    assert (
        p['overrides']['batch.sequence_parallel'] is True
        and 'batch.attention' not in p['overrides']
    )
    r = _py('layout', '--part', 'cluster', '--gpus', '8')
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout.splitlines()[:1] == ['cluster: layout: as_configured']
    assert 'refused, not downgraded' in r.stderr
    # the doctor's row, with its fix
    te = next(l for l in r.stderr.splitlines() if l.strip().startswith('Transformer Engine: found'))
    assert (
        'transformer-engine is not installed' in te
        and 'batch.sequence_parallel=True' in te
        and '; fix: ' in te
    ), te
    head = _py('preset', '--gpus', '8').stdout.splitlines()
    assert (
        head[0] == '# layout: as_configured'
        and yaml.safe_load('\n'.join(head))['overrides']['batch.sequence_parallel'] is True
    )


def test_reduced_names_its_layout_and_what_it_does_not_check():
    _no_te()
    gc = _gpu_check()
    p, rec = gc.cluster_layout('none', 8, reduced=True)
    assert rec['layout'] == 'reduced' and rec['reduced_layout'] == 'no-te'
    assert (
        p['overrides']['batch.sequence_parallel'] is False
        and p['overrides']['batch.attention'] == 'sdpa'
    )
    assert 'Transformer Engine' not in rec['failing_rows']
    assert any('sequence parallel' in x for x in rec['not_checked']) and any(
        'Transformer Engine attention' in x for x in rec['not_checked']
    )
    head = _py('preset', '--gpus', '8', '--reduced').stdout.splitlines()
    assert head[0].startswith('# layout: reduced (no-te: ') and head[1].startswith(
        '# not checked: Transformer Engine attention'
    )


def test_a_real_run_without_a_gpu_refuses_naming_the_rows(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip('needs a machine without CUDA')
    r = _run('--part', 'subset', '--out', str(tmp_path / 'o'))
    assert r.returncode == 2 and 'no CUDA device here' in r.stderr, r.stderr[-3000:]
    assert (
        'refused, not downgraded' in r.stderr
        and 'GPU count: found' in r.stderr
        and 'fix: ' in r.stderr
    )
    assert not (tmp_path / 'o').exists()


def test_cpu_simulation_is_the_subset_only():
    r = _run('--cpu-simulation', '--part', 'cluster')
    assert r.returncode == 2 and '--cpu-simulation runs only the subset' in r.stderr


def test_unknown_argument_is_named():
    r = _run('--dryrun')
    assert r.returncode == 2 and "unknown argument '--dryrun'" in r.stderr


def test_python3_when_python_is_absent(tmp_path):
    """A bare machine: no .venv, no `python` on PATH, PYTHON unset: the script takes `python3`
    (memagent through PYTHONPATH)."""
    import shutil

    (tmp_path / 'scripts').mkdir()
    (tmp_path / 'bin').mkdir()
    for f in ('gpu_check.sh', 'gpu_check.py'):
        shutil.copy(ROOT / 'scripts' / f, tmp_path / 'scripts' / f)
    (tmp_path / 'bin' / 'python3').write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    (tmp_path / 'bin' / 'python3').chmod(0o755)
    path = ':'.join(
        [str(tmp_path / 'bin')]
        + [d for d in ('/usr/bin', '/bin') if not (Path(d) / 'python').exists()]
    )
    env = {k: v for k, v in os.environ.items() if k not in ('PYTHON', 'VIRTUAL_ENV')} | {
        'PATH': path,
        'PYTHONPATH': str(ROOT),
    }
    r = subprocess.run(
        [
            'bash',
            str(tmp_path / 'scripts' / 'gpu_check.sh'),
            '--dry-run',
            '--part',
            'subset',
            '--out',
            str(tmp_path / 'o'),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"+ python3 scripts/gpu_check.py subset --out {tmp_path}/o/subset" in r.stdout


@pytest.mark.timeout(300)
def test_a_part_that_hangs_or_dies_hides_nothing_of_the_others(tmp_path, monkeypatch):
    """The subset's driver on a machine where one part's process never answers and another's dies:
    the first is stopped at its
        cap, the second recorded, the parts before and after them still run and report, and the
        whole
        subset fails."""
    import memagent.gpucheck.report as report

    fake = (
        tmp_path / 'python'
        # the interpreter the driver starts each part with (-m memagent.gpucheck.report NAME): $3 is
        # the
        # name
    )
    fake.write_text(
        '#!/usr/bin/env bash\ncase "$3" in\n  trainer) sleep 600 ;;\n  engine) echo "engine: '
        f'killed" >&2; exit 137 ;;\n  *) exec {sys.executable} "$@" ;;\nesac\n'
    )
    fake.chmod(0o755)
    monkeypatch.setattr(
        report, 'PARTS', tuple((n, 2 if n == 'trainer' else c, w) for n, c, w in report.PARTS)
    )
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '')
    out = tmp_path / 'out'
    body = report.run_subset(
        out, True, ['weight_sync', 'trainer', 'engine', 'step4b-sdpa-selective'], py=str(fake)
    )
    v = {n: p['verdict'] for n, p in body['parts'].items()}
    assert v == {
        'megatron': 'not run',
        'weight_sync': 'passed',
        'trainer': 'timeout',
        'engine': 'error',
        'step4b-local-full': 'not run',
        'step4b-sdpa-full': 'not run',
        'step4b-sdpa-selective': 'passed',
        'step4b-te-full': 'not run',
        'precision': 'not run',
        'optimizer': 'not run',
        'train-notebook': 'not run',
    }, v
    assert (
        body['parts']['trainer']['process']['timed_out']
        and body['parts']['trainer']['process']['seconds'] < 60
    )
    assert body['parts']['engine']['process']['rc'] == 137 and body['pass'] is False
    md = (out / 'subset.md').read_text()
    assert (
        '# gpu_check subset: FAIL' in md
        and '| trainer | timeout |' in md
        and '| step4b-sdpa-selective | passed |' in md
    )
    assert json.loads((out / 'subset.json').read_text())['parts']['weight_sync']['results'][
        'weight_sync'
    ]['pass']


def test_the_h200_reports_render_again_from_their_part_files(tmp_path):
    """`gpu_check.py render` on copies of the committed H200 runs: the part files stay byte for
    byte, every recorded split is
        called not reliable with the figures that show why, no part is named the largest, the model
        FLOPs are re-derived on the
        positions the head computes, and a phase peak above its planned phase fails its part. The
        committed reports are that
        rendering."""
    for run in ('gpu-20261204-step4b', 'gpu-20261204'):
        src, out = ROOT / 'reports/smoke' / run / 'subset', tmp_path / run
        shutil.copytree(src, out)
        r = _py('render', '--out', str(out))
        assert r.returncode == 0, r.stderr[-3000:]
        for f in (src / 'parts').rglob('*'):
            if f.is_file():
                assert (
                    out / 'parts' / f.relative_to(src / 'parts')
                ).read_bytes() == f.read_bytes(), f
        md, body = (out / 'subset.md').read_text(), json.loads((out / 'subset.json').read_text())
        # 3 parts + the summary
        assert (
            md.count('the split is NOT reliable') == 4
            and 'its largest part of the step is' not in md
        ), md
        assert body['step4b_side_by_side']['sdpa_largest_part']['part'] is None
        committed = json.loads((src / 'subset.json').read_text())
        assert (
            body['provenance'] == committed['provenance'] and body['parts'] == committed['parts']
        ), run
        assert (
            md.split('Rendered again')[1].split('\n', 1)[1]
            == (src / 'subset.md').read_text().split('Rendered again')[1].split('\n', 1)[1]
        )
        for name in ('step4b-local-full', 'step4b-sdpa-full', 'step4b-sdpa-selective'):
            st = body['parts'][name]['results']['step']
            rec = json.loads((src / 'parts' / f'{name}.json').read_text())['results']['step']
            assert (
                st['head_positions'] * 2 == st['tokens']
                and st['model_tflops'] < 0.97 * rec['model_tflops']
            ), (name, st['model_tflops'])
            assert (
                st['rederived']['figures']['fraction_of_matmul_rate']['recorded']
                == rec['fraction_of_matmul_rate']
            )
            assert not st['split_checks']['reliable'] and 'phases' in st['split_checks']['missing']
            assert 'timed step' in st['split_checks']['disagree']
    sb = json.loads((tmp_path / 'gpu-20261204-step4b/subset.json').read_text())
    assert sb['parts']['step4b-local-full']['verdict'] == 'failed' and sb['pass'] is False
    assert sb['parts']['step4b-local-full']['results']['step']['memory_by_phase']['optimizer step'][
        'over'
    ]
    assert (
        'memory check FAILED: optimizer step peak 85.1 GiB above its planned 82.6 GiB'
        in (tmp_path / 'gpu-20261204-step4b/subset.md').read_text()
    )
    assert sb['parts']['step4b-sdpa-full']['verdict'] == 'passed'


def test_a_split_that_adds_up_names_the_largest_part_and_one_that_does_not_names_none(tmp_path):
    """The sdpa-full part of the H200 run with a split that adds up (its parts equal the kernels,
    fit the wall time and the
        timed step, and its optimizer share is the timed one): the report names its largest part.
        Then
        the same with the
        optimizer timed at a tenth of its share, and with no phases timed: not reliable, no largest
        part."""
    import memagent.gpucheck.report as report

    run = ROOT / 'reports/smoke/gpu-20261204-step4b/subset'
    rep = json.loads((run / 'subset.json').read_text())
    layout = {
        **{k: rep[k] for k in ('layout', 'reduced_layout', 'reduced_because', 'not_checked')},
        'rows': rep['doctor_rows'],
    }
    fixed = {
        'layout': layout,
        'cpu_simulation': False,
        'environment': rep['environment'],
        'transformer_engine': False,
        'device': rep['device'],
    }
    for case, reliable in (
        ('agrees', True),
        ('optimizer timed apart', False),
        ('no phases', False),
    ):
        out = tmp_path / case.replace(' ', '-')
        (out / 'parts').mkdir(parents=True)
        body = json.loads((run / 'parts/step4b-sdpa-full.json').read_text())
        st, sp = body['results']['step'], body['results']['step']['split']
        secs = {
            'attention core': 0.12,
            'attention projections': 0.09,
            'MLP': 0.33,
            'norms': 0.05,
            'log-prob head': 0.04,
            'gradient reduction': 0.0,
            'optimizer': 0.13,
            'other': 0.10,
        }
        sp.update(
            seconds=secs,
            total_s=sum(secs.values()),
            device_s=sum(secs.values()),
            unattributed_s=0.0,
            share={k: v / sum(secs.values()) for k, v in secs.items()},
        )
        opt = {
            'agrees': secs['optimizer'] / sum(secs.values()),
            'optimizer timed apart': 0.015,
        }.get(case)
        st['phases_s'] = (
            None
            if opt is None
            else {'forward': 0.3, 'backward (with recompute)': 0.6 - opt, 'optimizer step': opt}
        )
        (out / 'parts/step4b-sdpa-full.json').write_text(json.dumps(body))
        b = report.write_report(
            out,
            fixed,
            {'step4b-sdpa-full': {'rc': 0, 'timed_out': False, 'seconds': 1.0, 'cap_s': 45}},
            1.0,
        )
        md = (out / 'subset.md').read_text()
        assert (
            b['parts']['step4b-sdpa-full']['results']['step']['split_checks']['reliable']
            is reliable
        ), case
        row = next(r for r in b['step4b_side_by_side']['rows'] if r['part'] == 'step4b-sdpa-full')
        assert row['split_reliable'] is reliable
        if reliable:
            assert 'the split is reliable' in md and 'MLP 38%' in md and 'NOT reliable' not in md, (
                md
            )
        else:
            assert 'the split is NOT reliable' in md and 'MLP 38%' not in md, md


def test_a_models_folder_that_is_missing_or_empty_is_refused_not_read_as_none(tmp_path):
    """`--models` (or MEMAGENT_MODELS) naming a folder that does not exist, or holds neither recipe
    model, stops the check with exit 2 naming the folder and what it looked for; nothing is written;
    the tiny preset is never picked in its place."""
    empty = tmp_path / 'models'
    empty.mkdir()
    (empty / 'Qwen3-4B').mkdir()  # a model folder without its config.json
    for models, why in (
        (tmp_path / 'nope', 'no such folder'),
        (empty, 'holds neither recipe model'),
    ):
        out = tmp_path / 'out'
        r = _run('--dry-run', '--part', 'cluster', '--models', str(models), '--out', str(out))
        assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-500:])
        assert (
            f'--models {models}: {why}' in r.stderr and f'{models}/Qwen3-4B/config.json' in r.stderr
        ), r.stderr
        assert 'preset: tiny' not in r.stdout and not out.exists()
        r = _py('preset', '--models', str(models), '--gpus', '8')
        assert r.returncode == 2 and why in r.stderr and r.stdout == ''
    assert [p.name for p in empty.iterdir()] == ['Qwen3-4B']


def test_an_unknown_part_or_an_out_folder_among_the_sources_is_refused_before_any_write(tmp_path):
    """`gpu_check.py part` with a name that is no part (or a path) and `gpu_check.sh --out` inside a
    source folder exit 2 and write nothing."""
    for name in ('nope', '../escape'):
        r = _py('part', name, '--out', str(tmp_path / 'o'), '--cpu-simulation')
        assert (
            r.returncode == 2
            and f"unknown part {name!r}" in r.stderr
            and not (tmp_path / 'o').exists()
            and not (tmp_path / 'escape.json').exists()
        ), r.stderr
    before = sorted(p.name for p in (ROOT / 'nbs').iterdir())
    r = _run('--dry-run', '--part', 'cluster', '--out', 'nbs')
    assert r.returncode == 2 and '--out nbs is inside the source folder nbs/' in r.stderr, r.stderr
    assert sorted(p.name for p in (ROOT / 'nbs').iterdir()) == before


def test_part_all_refuses_the_cluster_part_before_the_subset_writes(tmp_path):
    """--part all with a --models folder that does not exist stops before the subset's mkdir:
    nothing under --out."""
    out = tmp_path / 'gpu'
    r = _run('--part', 'all', '--models', str(tmp_path / 'none-here'), '--out', str(out))
    assert (
        r.returncode == 2
        and f"--models {tmp_path / 'none-here'}: no such folder" in r.stderr
        and not out.exists()
    ), (r.returncode, r.stderr[-800:])
    assert '== subset' not in r.stdout, 'the subset started before the cluster part was checked'


def test_one_part_of_the_subset_runs_alone():
    """`--part NAME` for a part of the subset runs the subset with that part only; a name that is no
    part is refused (exit 2)."""
    r = _run('--dry-run', '--part', 'train-notebook', '--out', '/tmp/gpu-check-one-part')
    assert (
        r.returncode == 0
        and (
            'scripts/gpu_check.py subset --out /tmp/gpu-check-one-part/subset --parts '
            'train-notebook'
        )
        in r.stdout
    ), r.stdout[-2000:]
    assert '== cluster' not in r.stdout
    r = _run('--dry-run', '--part', 'nope')
    assert (
        r.returncode == 2
        and "--part must be subset, cluster, all or a part of the subset, got 'nope'" in r.stderr
    )
