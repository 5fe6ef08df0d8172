"""Every console tool that takes input files and an output path refuses an output that would replace
one of its inputs
(however spelt), naming both, with the refusal exit code 2, and writes nothing: the folder is
byte-identical afterwards."""

import json
from pathlib import Path

import pytest

from memagent.acceptance import compare_cli
from memagent.data import convert_cli, haystack_cli
from memagent.evaluate import evaluate_cli
from memagent.observed import audit_cli


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob('*')) if p.is_file()}


def _runs(d: Path):
    for r in ('cand', 'ref', 'base'):
        (d / r).mkdir()
        (d / r / 'summary.json').write_text('{"a": 1}\n')
        (d / r / 'records.jsonl').write_text('{}\n')


CASES = [
    (
        'memagent-convert: output = input',
        convert_cli,
        lambda d: [str(d / 'in.jsonl'), str(d / 'in.jsonl')],
        'the output',
    ),
    (
        'memagent-convert: output = input, spelt another way',
        convert_cli,
        lambda d: [str(d / 'in.jsonl'), str(d / 'sub' / '..' / 'in.jsonl')],
        'the output',
    ),
    (
        'memagent-convert: manifest = input',
        convert_cli,
        lambda d: [str(d / 'in.jsonl'), str(d / 'o.jsonl'), '--manifest', str(d / 'in.jsonl')],
        'the manifest',
    ),
    (
        'memagent-haystack: output = pool',
        haystack_cli,
        lambda d: [str(d / 'in.jsonl'), str(d / 'in.jsonl'), '--num-docs', '3'],
        'the output',
    ),
    (
        'memagent-haystack: manifest = questions',
        haystack_cli,
        lambda d: [
            str(d / 'pool.jsonl'),
            str(d / 'o.jsonl'),
            '--num-docs',
            '3',
            '--questions',
            str(d / 'in.jsonl'),
            '--manifest',
            str(d / 'in.jsonl'),
        ],
        'the manifest',
    ),
    (
        'memagent-evaluate: --data is the records file of --out',
        evaluate_cli,
        lambda d: ['--model', 'tiny-qwen3', '--data', str(d / 'records.jsonl'), '--out', str(d)],
        'the --data',
    ),
    (
        'memagent-evaluate: --config is inside --out',
        evaluate_cli,
        lambda d: [
            '--model',
            'tiny-qwen3',
            '--data',
            str(d / 'in.jsonl'),
            '--config',
            str(d / 'ev' / 'c.yaml'),
            '--out',
            str(d / 'ev'),
        ],
        'the --config',
    ),
    (
        'memagent-compare: --out is a file of a run it reads',
        compare_cli,
        lambda d: [
            '--candidate',
            str(d / 'cand'),
            '--reference',
            str(d / 'ref'),
            '--base',
            str(d / 'base'),
            '--out',
            str(d / 'ref' / 'summary.json'),
        ],
        "the --out",
    ),
]


@pytest.mark.parametrize('cli,args,says', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_output_that_would_replace_an_input_is_refused_and_nothing_is_written(
    tmp_path, capsys, cli, args, says
):
    for f in ('in.jsonl', 'pool.jsonl', 'records.jsonl'):
        (tmp_path / f).write_text(json.dumps({'id': f}) + '\n')
    (tmp_path / 'sub').mkdir()
    _runs(tmp_path)
    (tmp_path / 'ev').mkdir()
    (tmp_path / 'ev' / 'c.yaml').write_text('seed: 1\n')
    before = _tree(tmp_path)
    assert cli(args(tmp_path)) == 2
    err = capsys.readouterr().err
    assert says in err and 'would replace the input' in err, err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize(
    'study,inputs',
    [
        ([], ('fixtures.json', 'protocol.md')),
        (['--study', 'observed'], ('episodes.json', 'protocol.md')),
        (['--study', 'advantages'], ('groups.json', 'protocol.md')),
    ],
    ids=['reward', 'observed', 'advantages'],
)
def test_memagent_audit_refuses_a_receipt_that_would_replace_its_inputs(
    tmp_path, capsys, study, inputs
):
    """Every study's command: --out naming an input (however spelt) is refused with exit 2 before
    the checkout is read; nothing changes."""
    for f in inputs:
        (tmp_path / f).write_text('{}\n')
    (tmp_path / 'sub').mkdir()
    before = _tree(tmp_path)
    for f in inputs:
        out = tmp_path / 'sub' / '..' / f
        assert (
            audit_cli(
                [
                    *study,
                    '--source-repo',
                    str(tmp_path / 'no-checkout'),
                    '--report-dir',
                    str(tmp_path),
                    '--out',
                    str(out),
                ]
            )
            == 2
        )
        assert 'would replace the input' in capsys.readouterr().err
    assert _tree(tmp_path) == before


# ---- run notebooks: a report into the repository's reports/ from a tree that differs from HEAD is
# refused before any write ----

RUN_NOTEBOOKS_WITH_REPORTS = [
    'acceptance',
    'agemem_advantages',
    'agemem_audit',
    'agemem_observed',
    'bench',
    'launch',
    'loss_parity',
    'parity',
    'plan',
    'rehearsal',
    'simulate',
    'smoke',
    'train',
]
ROOT = Path(__file__).resolve().parents[1]


def _code_cells(name):
    return [
        ''.join(c['source'])
        for c in json.loads((ROOT / 'nbs' / f'{name}.ipynb').read_text())['cells']
        if c['cell_type'] == 'code'
    ]


def test_a_report_folder_of_an_unclean_tree_is_refused_naming_the_files(tmp_path):
    """memagent.report.refuse_unclean_report_dir in a repository whose tracked source differs from
    HEAD: reports/ refused, naming the file; elsewhere allowed."""
    import subprocess
    from memagent.provenance import refuse_unclean_report_dir

    g = lambda *a: subprocess.run(['git', '-C', str(tmp_path), *a], check=True, capture_output=True)
    g('init', '-q')
    (tmp_path / 'a.py').write_text('x = 1\n')
    g('add', 'a.py')
    g('-c', 'user.email=t@t', '-c', 'user.name=t', 'commit', '-qm', 'a')
    refuse_unclean_report_dir(tmp_path / 'reports' / 'plan' / 'x')  # clean: fine
    (tmp_path / 'a.py').write_text('x = 2\n')
    with pytest.raises(
        ValueError,
        match=(
            r"parameter out_root: .*reports/plan/x is under the repository's reports/.*\['a.py'\]"
        ),
    ):
        refuse_unclean_report_dir(tmp_path / 'reports' / 'plan' / 'x', 'parameter out_root')
    refuse_unclean_report_dir(tmp_path / 'elsewhere')  # not a committed report: fine


@pytest.mark.parametrize('name', RUN_NOTEBOOKS_WITH_REPORTS)
def test_run_notebook_checks_the_tree_in_its_parameter_checks(name):
    """Each run notebook that renders into reports/ calls the tree check in the two cells after its
    parameters, which write nothing."""
    cells = _code_cells(name)
    nbj = json.loads((ROOT / 'nbs' / f'{name}.ipynb').read_text())['cells']
    i = [
        j
        for j, c in enumerate([c for c in nbj if c['cell_type'] == 'code'])
        if 'parameters' in c['metadata'].get('tags', [])
    ][0]
    checks = '\n'.join(cells[i + 1 : i + 3])
    assert 'refuse_unclean_report_dir(' in checks, name
    before = checks.split('refuse_unclean_report_dir(')[0]
    for w in (
        '.mkdir(',
        'write_text(',
        'write_examples(',
        'savefig(',
        'rmtree(',
        "open(",
        'write_receipt(',
    ):
        assert w not in before, f"{name}: {w} before the tree check"


def test_plan_notebook_refuses_an_unclean_tree_before_writing(tmp_path):
    """The plan notebook's own cells, rendering into the reports/ of a clone whose source differs
    from HEAD: refused, the clone unchanged."""
    import subprocess

    clone = tmp_path / 'clone'
    subprocess.run(['git', 'clone', '-q', '--depth', '1', f'file://{ROOT}', str(clone)], check=True)
    (clone / 'settings.ini').write_text((clone / 'settings.ini').read_text() + '\n# edited\n')
    before = _tree(clone / 'reports')
    cells, ns = _code_cells('plan'), {}
    exec(cells[0], ns)
    ns.update(out_root=str(clone / 'reports' / 'plan'), run='x')
    with pytest.raises(
        ValueError, match=r"parameter out_root: .* is under the repository's reports/.*settings.ini"
    ):
        for src in cells[1:]:
            exec(src, ns)
    assert _tree(clone / 'reports') == before and not (clone / 'reports' / 'plan' / 'x').exists()


def _run_checks(name, params, cells=1):
    """A run notebook's parameters cell, then `params`, then the `cells` cells after it (its
    checks), as papermill would run them; their error raised."""
    from memagent.testing import run_notebook_cells

    _, err = run_notebook_cells(ROOT / 'nbs' / f'{name}.ipynb', params, cells)
    if err is not None:
        raise err


@pytest.mark.parametrize('name', ['smoke', 'rehearsal'])
def test_an_earlier_run_without_overwrite_is_refused_in_the_checks_not_recorded_and_run_past(
    tmp_path, name
):
    """overwrite=False and a non-empty run or report folder of that name: FileExistsError from the
    checks cell (it was a gate failure the notebook ran past, rewriting the report); nothing
    changes."""
    runs, reps = tmp_path / 'runs', tmp_path / 'reports'
    (runs / 'r').mkdir(parents=True)
    (runs / 'r' / 'metrics.jsonl').write_text('{"step": 1}\n')
    (reps / 'r').mkdir(parents=True)
    (reps / 'r' / 'README.md').write_text('# an earlier report\n')
    before = _tree(tmp_path)
    with pytest.raises(
        FileExistsError, match=r"runs/r exists and is not empty \(set overwrite=True"
    ):
        _run_checks(
            name, {'run': 'r', 'out_dir': str(runs), 'report_dir': str(reps), 'overwrite': False}
        )
    assert _tree(tmp_path) == before
    (runs / 'r' / 'metrics.jsonl').unlink()
    (runs / 'r').rmdir()
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=r"reports/r exists and is not empty"):
        _run_checks(
            name, {'run': 'r', 'out_dir': str(runs), 'report_dir': str(reps), 'overwrite': False}
        )
    assert _tree(tmp_path) == before


def test_smoke_refuses_data_inside_the_run_directory_it_would_empty(tmp_path):
    runs = tmp_path / 'runs'
    (runs / 'r').mkdir(parents=True)
    data = runs / 'r' / 'd.jsonl'
    data.write_text('{}\n')
    with pytest.raises(
        ValueError, match=r"parameter data=.* is inside the run directory .*overwrite=True empties"
    ):
        _run_checks(
            'smoke',
            {
                'run': 'r',
                'out_dir': str(runs),
                'report_dir': str(tmp_path / 'rep'),
                'data': str(data),
            },
        )
    assert data.read_text() == '{}\n'


@pytest.mark.parametrize(
    'params,needle',
    [
        ({'model': './no-such-model'}, 'parameter model: model'),
        ({'recipe': 'nope'}, "preset 'nope'"),
        ({'eval_chunk_tokens': 100000}, "config key 'batch.max_tokens_per_micro'"),
    ],
)
def test_bench_refuses_its_models_and_presets_before_making_its_folder(tmp_path, params, needle):
    """The bench notebook's checks cell resolves its model names (without building or loading), its
    presets and the evaluation section's configuration before it creates its report folder."""
    with pytest.raises((ValueError, KeyError)) as e:
        _run_checks(
            'bench', {'out_root': str(tmp_path / 'rep'), 'run': 'x', 'quick': True, **params}
        )
    assert needle in str(e.value) and not (tmp_path / 'rep').exists(), str(e.value)


def test_acceptance_refuses_a_reused_run_and_an_unresolvable_model_in_its_checks(tmp_path):
    """A run_name whose folder holds an earlier gate, and a candidate checkpoint that is not there:
    refused by the checks cell, nothing written."""
    old = tmp_path / 'acc' / 'r'
    old.mkdir(parents=True)
    (old / 'gate.json').write_text('{}\n')
    before = _tree(tmp_path)
    base = {
        'out_root': str(tmp_path / 'acc'),
        'preset': 'tiny',
        'base_model': 'tiny-qwen3',
        'reference_model': 'tiny-qwen3',
        'candidate_model': 'tiny-qwen3',
        'eval_data': 'sample-haystack-2',
    }
    with pytest.raises(FileExistsError, match=r"run_name='r': .*acc/r exists and is not empty"):
        _run_checks('acceptance', {**base, 'run_name': 'r'})
    with pytest.raises(
        ValueError,
        match=(
            r"parameter candidate_model='./no-such-checkpoint': model './no-such-checkpoint': no "
            r"such directory"
        ),
    ):
        _run_checks(
            'acceptance', {**base, 'run_name': 'new', 'candidate_model': './no-such-checkpoint'}
        )
    assert _tree(tmp_path) == before and not (tmp_path / 'acc' / 'new').exists()


def test_agemem_audit_refuses_a_receipt_path_that_is_one_of_its_inputs(tmp_path):
    "mode='run' with out = the fixtures file: refused in the checks, the fixtures untouched."
    rep = tmp_path / 'audit'
    rep.mkdir()
    for f in ('fixtures.json', 'protocol.md'):
        (rep / f).write_bytes((ROOT / 'reports' / 'agemem_audit' / f).read_bytes())
    before = _tree(rep)
    with pytest.raises(ValueError, match=r"the out .*fixtures.json is the fixtures"):
        _run_checks(
            'agemem_audit',
            {
                'mode': 'run',
                'source_repo': str(tmp_path),
                'report_dir': str(rep),
                'out': str(rep / 'sub' / '..' / 'fixtures.json'),
            },
            cells=2,
        )
    assert _tree(rep) == before


def test_parity_refuses_a_report_folder_inside_an_upstream_checkout(tmp_path):
    up, rx = tmp_path / 'official', tmp_path / 'relax'
    up.mkdir()
    rx.mkdir()
    with pytest.raises(
        ValueError, match=r"parameter report_dir: .*official/out is inside official_dir"
    ):
        _run_checks(
            'parity',
            {
                'mode': 'run',
                'official_dir': str(up),
                'relax_dir': str(rx),
                'report_dir': str(up / 'out'),
            },
        )
    assert not (up / 'out').exists()


def test_smoke_refuses_a_bad_data_file_in_its_checks(tmp_path):
    bad = tmp_path / 'd.jsonl'
    bad.write_text('{"id": "a"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl: line 1: field 'question': missing field"):
        _run_checks(
            'smoke',
            {
                'run': 'r',
                'out_dir': str(tmp_path / 'runs'),
                'report_dir': str(tmp_path / 'rep'),
                'data': str(bad),
            },
        )
    assert not (tmp_path / 'runs').exists() and not (tmp_path / 'rep').exists()
