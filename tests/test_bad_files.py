"""Every console tool reads its files through `memagent.files`, so every one refuses the same bad
files the same way:
exit 2, the file named, no traceback and no output written. The entry points are read from
settings.ini; a new tool
fails `test_every_console_script_is_covered` until its inputs are listed here."""

import configparser, contextlib, io, os
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
BAD = {
    'nesting bomb': ('[' * 100_000 + ']' * 100_000).encode(),
    'wrong shape': b'[1, 2]',
    'not UTF-8': '{"a": 1}'.encode('utf-16'),
    'duplicate key': b'{"a": 1, "a": 2}',
    'empty': b'',
}


def console_scripts() -> dict:
    c = configparser.ConfigParser()
    c.read(ROOT / 'settings.ini')
    return dict(s.split('=', 1) for s in c['DEFAULT']['console_scripts'].split())


def _write(p: Path, data: bytes, jsonl=False) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data + (b'\n' if jsonl and data else b''))
    return p


def _runs(t: Path, bad: bytes):
    """`{name: (argv, bad file, outputs that must not appear)}`: each tool with the bad bytes as one
    of its inputs."""
    yield (
        'memagent-convert',
        'a .json source',
        [str(_write(t / 'in.json', bad)), str(t / 'out.jsonl')],
        t / 'in.json',
        [t / 'out.jsonl', t / 'out.jsonl.manifest.json'],
    )
    yield (
        'memagent-convert',
        'a .jsonl source',
        [str(_write(t / 'in.jsonl', bad, True)), str(t / 'o2.jsonl')],
        t / 'in.jsonl',
        [t / 'o2.jsonl'],
    )
    yield (
        'memagent-haystack',
        'the pool',
        [str(_write(t / 'pool.json', bad)), str(t / 'hay.jsonl'), '--num-docs', '2'],
        t / 'pool.json',
        [t / 'hay.jsonl'],
    )
    yield (
        'memagent-evaluate',
        '--data',
        [
            '--model',
            'tiny-qwen3',
            '--preset',
            'tiny',
            '--data',
            str(_write(t / 'd.jsonl', bad, True)),
            '--out',
            str(t / 'ev'),
        ],
        t / 'd.jsonl',
        [t / 'ev'],
    )
    yield (
        'memagent-evaluate',
        '--config',
        [
            '--model',
            'tiny-qwen3',
            '--data',
            str(t / 'd.jsonl'),
            '--config',
            str(_write(t / 'c.yaml', bad)),
            '--out',
            str(t / 'ev2'),
        ],
        t / 'c.yaml',
        [t / 'ev2'],
    )
    (t / 'src').mkdir(exist_ok=True)
    yield (
        'memagent-prepare',
        "the source's manifest",
        ['--from', str(t / 'src'), '--root', str(t / 'root'), '--unverified'],
        _write(t / 'src' / 'manifest.json', bad),
        [t / 'root' / 'manifest.json'],
    )
    yield (
        'memagent-prepare',
        "the root's manifest",
        ['--from', str(t / 'src2'), '--root', str(t / 'root2'), '--unverified'],
        _write(t / 'root2' / 'manifest.json', bad),
        [t / 'root2' / 'hotpotqa_dev.jsonl'],
    )
    for r in ('c', 'r', 'b'):
        _write(t / r / 'summary.json', bad)
    yield (
        'memagent-compare',
        'a summary',
        [
            '--candidate',
            str(t / 'c'),
            '--reference',
            str(t / 'r'),
            '--base',
            str(t / 'b'),
            '--out',
            str(t / 'cmp.json'),
        ],
        t / 'c' / 'summary.json',
        [t / 'cmp.json'],
    )
    yield (
        'memagent-compare',
        '--verify: the folder\'s compare.json',
        ['--verify', str(t / 'acc')],
        _write(t / 'acc' / 'compare.json', bad),
        [],
    )
    _write(
        t / 'acc2' / 'compare.json',
        b'{"lengths": [3], "metric": "m", "hotpotqa_metric": "b", "require_hotpotqa": false, '
        b'"tolerance_pp": 3.0, "bootstrap": {}, "values": {}, "runs": {}}',
    )
    yield (
        'memagent-compare',
        "--verify: the folder's render.json",
        ['--verify', str(t / 'acc2')],
        _write(t / 'acc2' / 'render.json', bad),
        [],
    )
    _write(t / 'run' / 'run.json', b'{"steps": 1, "config": {}, "provenance": {}}')
    yield (
        'memagent-reward-summary',
        'metrics.jsonl',
        [str(t / 'run')],
        _write(t / 'run' / 'metrics.jsonl', bad, True),
        [t / 'run' / 'reward_summary.json'],
    )
    _write(t / 'run2' / 'metrics.jsonl', b'{"step": 1, "reward_mean": 0.1, "pass_rate": 0.1}\n')
    yield (
        'memagent-reward-summary',
        'run.json',
        [str(t / 'run2')],
        _write(t / 'run2' / 'run.json', bad),
        [t / 'run2' / 'reward_summary.json'],
    )
    yield (
        'memagent-audit',
        'the receipt',
        ['--verify', '--receipt', str(_write(t / 'rec.json', bad))],
        t / 'rec.json',
        [],
    )
    yield (
        'memagent-audit',
        "the second study's receipt",
        ['--study', 'observed', '--verify', '--receipt', str(_write(t / 'rec2.json', bad))],
        t / 'rec2.json',
        [],
    )
    yield (
        'memagent-audit',
        "the third study's receipt",
        ['--study', 'advantages', '--verify', '--receipt', str(_write(t / 'rec3.json', bad))],
        t / 'rec3.json',
        [],
    )


NOT_APPLICABLE = {
    'memagent-doctor': (
        'reads files only inside its rows: a bad file fails its row, naming the file '
        '(test_doctor_names_a_bad_manifest_in_its_row), and the doctor exits 1 with the table'
    )
}


def _call(target: str, argv):
    import importlib

    mod, fn = target.split(':')
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = getattr(importlib.import_module(mod), fn)(argv)
    except SystemExit as e:
        rc = e.code
    return rc, err.getvalue() + out.getvalue()


def test_every_console_script_is_covered(tmp_path):
    covered = {name for name, *_ in _runs(tmp_path, b'{}')}
    assert covered | set(NOT_APPLICABLE) == set(console_scripts()), set(console_scripts()) ^ (
        covered | set(NOT_APPLICABLE)
    )


@pytest.mark.parametrize('case', list(BAD))
def test_every_console_tool_refuses_a_bad_file_naming_it(tmp_path, case):
    scripts, seen = console_scripts(), []
    for name, what, argv, bad_file, outputs in _runs(tmp_path / case.replace(' ', '_'), BAD[case]):
        # an exception escaping here is the traceback a user would see
        rc, said = _call(scripts[name], argv)
        seen.append(name)
        assert rc == 2, (name, what, rc, said[-500:])
        assert str(bad_file) in said, (name, what, said[-500:])
        assert 'Traceback' not in said, (name, what, said[-500:])
        assert not any(Path(o).exists() for o in outputs), (
            name,
            what,
            [o for o in outputs if Path(o).exists()],
        )
    assert set(seen) == set(scripts) - set(NOT_APPLICABLE)


def test_doctor_names_a_bad_manifest_in_its_row(tmp_path):
    from memagent.doctor import doctor_cli

    _write(tmp_path / 'manifest.json', BAD['nesting bomb'])
    rc, said = _call(
        'memagent.doctor:doctor_cli',
        [
            '--preset',
            'qwen3-4b-frozen',
            '--world-size',
            '8',
            '--data-root',
            str(tmp_path),
            '--rows',
            'pinned data',
        ],
    )
    assert (
        rc == 1
        and 'FAIL' in said
        and f"repair or remove {tmp_path / 'manifest.json'}" in ' '.join(said.split())
    ), said


def test_memagent_audit_works_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from memagent.observed.receipt import audit_cli

    rc, said = _call('memagent.observed.receipt:audit_cli', ['--help'])
    assert rc == 0 and '--report-dir' in said
    rc, said = _call('memagent.observed.receipt:audit_cli', ['--verify'])
    assert rc == 2 and 'no settings.ini' in said and '--report-dir' in said
    rc, said = _call(
        'memagent.observed.receipt:audit_cli',
        ['--verify', '--report-dir', str(ROOT / 'reports' / 'agemem_audit')],
    )
    assert rc == 0, said[-500:]


# ---- one way to write: an output never replaces an input or another output, and a refusal writes
# nothing ----


def _tree(root: Path) -> dict:
    """Every file under `root` (symlinks as their target) with its bytes: what a refusal must leave
    as it was."""
    return {
        str(p.relative_to(root)): (os.readlink(p) if p.is_symlink() else p.read_bytes())
        for p in sorted(root.rglob('*'))
        if p.is_symlink() or p.is_file()
    }


def _aliasing(t: Path):
    """`(tool, what, argv)`: each console tool given an output that is one of its inputs or another
    output, however spelt."""
    from memagent.data import load_hotpotqa
    import json

    rows = load_hotpotqa(limit=3)
    pool = t / 'pool.jsonl'
    pool.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    (t / 'link.jsonl').symlink_to(pool)
    os.link(pool, t / 'hard.jsonl')
    yield (
        'memagent-convert',
        'the manifest is the output',
        [str(pool), str(t / 'o.jsonl'), '--manifest', str(t / 'o.jsonl')],
    )
    yield (
        'memagent-convert',
        'the output is a symlink to the input',
        [str(pool), str(t / 'link.jsonl')],
    )
    yield (
        'memagent-convert',
        'the output is a hard link to the input',
        [str(pool), str(t / 'hard.jsonl')],
    )
    yield (
        'memagent-convert',
        "the output is the input through '..'",
        [str(pool), str(t / 'sub' / '..' / 'pool.jsonl')],
    )
    yield (
        'memagent-haystack',
        'the manifest is the output',
        [str(pool), str(t / 'h.jsonl'), '--num-docs', '10', '--manifest', str(t / 'h.jsonl')],
    )
    yield (
        'memagent-haystack',
        'the output is a symlink to the pool',
        [str(pool), str(t / 'link.jsonl'), '--num-docs', '10'],
    )
    run = t / 'run'
    run.mkdir()
    (run / 'run.json').write_text('{"steps": 1, "config": {}, "provenance": {}}')
    (run / 'metrics.jsonl').write_text('{"step": 1, "reward_mean": 0.1, "pass_rate": 0.1}\n')
    (run / 'reward_by_step.csv').symlink_to(run / 'metrics.jsonl')
    yield 'memagent-reward-summary', 'reward_by_step.csv is a symlink to metrics.jsonl', [str(run)]
    ev = t / 'ev'
    ev.mkdir()
    (ev / 'data.jsonl').write_bytes(pool.read_bytes())
    yield (
        'memagent-evaluate',
        'the data is inside the output folder',
        ['--model', 'tiny-qwen3', '--data', str(ev / 'data.jsonl'), '--out', str(ev)],
    )
    for r in ('c', 'r', 'b'):
        (t / r).mkdir()
        (t / r / 'summary.json').write_text('{}')
    yield (
        'memagent-compare',
        "--out is the candidate's summary",
        [
            '--candidate',
            str(t / 'c'),
            '--reference',
            str(t / 'r'),
            '--base',
            str(t / 'b'),
            '--out',
            str(t / 'c' / 'summary.json'),
        ],
    )
    yield (
        'memagent-compare',
        '--out is a folder',
        [
            '--candidate',
            str(t / 'c'),
            '--reference',
            str(t / 'r'),
            '--base',
            str(t / 'b'),
            '--out',
            str(t / 'r'),
        ],
    )


ALIASING_NOT_APPLICABLE = {
    'memagent-prepare': (
        "its outputs are the data root's own files, written through a staging folder: --from the "
        "root itself copies each file to staging and verifies it before it replaces anything "
        "(test_prepare_refused_leaves_the_root_as_it_was)"
    ),
    'memagent-audit': (
        'an --out that is one of its inputs: '
        'tests/test_refuse_overwrite.py::test_memagent_audit_refuses_a_receipt_that_would_replace_its_inputs'
    ),
    'memagent-doctor': 'writes no file',
}


def test_no_console_tool_writes_over_its_inputs(tmp_path):
    scripts, seen = console_scripts(), set()
    for name, what, argv in _aliasing(tmp_path):
        before = _tree(tmp_path)
        rc, said = _call(scripts[name], argv)
        seen.add(name)
        assert rc == 2 and 'Traceback' not in said, (name, what, rc, said[-400:])
        assert _tree(tmp_path) == before, (name, what, 'the tree changed')
    assert seen | set(ALIASING_NOT_APPLICABLE) == set(scripts), set(scripts) ^ (
        seen | set(ALIASING_NOT_APPLICABLE)
    )


def test_prepare_refused_leaves_the_root_as_it_was(tmp_path):
    """memagent-prepare --from a folder without the file: the root's earlier copy, conversion and
    manifest stay byte for byte."""
    import json
    from test_acceptance_nb import pinned_format_root

    root = pinned_format_root(tmp_path)
    before = _tree(root)
    empty = tmp_path / 'empty'
    empty.mkdir()
    rc, said = _call(
        console_scripts()['memagent-prepare'],
        ['--from', str(empty), '--root', str(root), '--unverified', '--files', 'eval_50.json'],
    )
    assert rc == 2 and 'eval_50.json: not in' in said, said
    assert _tree(root) == before


def test_an_interrupted_evaluation_leaves_the_earlier_run(tmp_path):
    """A second evaluation into the same folder stops after its first batch: the first run's records
    and summary stay as they were."""
    import json
    from memagent.config import get_preset
    from memagent.data import make_synthetic, write_examples
    from memagent.engines import HFEngine
    from memagent.evaluate import evaluate
    from memagent.models import load_model, load_tokenizer

    cfg = get_preset('tiny', {'chunking.max_chunks': 2, 'eval.top_p': 1.0})
    tok = load_tokenizer('tiny-qwen3')
    eng = HFEngine(load_model('tiny-qwen3'), tok)
    data = write_examples(make_synthetic(4, num_words=30, seed=1), tmp_path / 'd.jsonl')
    out = tmp_path / 'ev'
    evaluate(
        data,
        eng,
        tok,
        cfg,
        out_dir=out,
        samples=1,
        batch_size=2,
        progress=False,
        n_boot=20,
        max_items=None,
    )
    before = _tree(out)
    calls, generate = [0], eng.generate

    def stop_after_one_batch(*a, **k):
        calls[0] += 1
        if calls[0] > 3:
            raise KeyboardInterrupt
        return generate(*a, **k)

    eng.generate = stop_after_one_batch
    with (
        pytest.raises(KeyboardInterrupt),
        pytest.warns(UserWarning, match='what it finished is in'),
    ):
        evaluate(
            data,
            eng,
            tok,
            cfg,
            out_dir=out,
            samples=1,
            batch_size=2,
            progress=False,
            n_boot=20,
            max_items=None,
        )
    assert _tree(out) == before
    work = tmp_path / f'.running-{os.getpid()}-ev'
    # what it finished: the first batch's two items
    assert (work / 'records.jsonl').read_text().count('\n') == 2


# ---- run notebooks: the check cell reads every input file through memagent.files and refuses one
# inside an output folder ----

import json, shutil
from test_config import RUN_NOTEBOOKS


def _records(p: Path) -> Path:
    "Two rows of the memagent record schema, as JSONL at `p`."
    from memagent.data import make_synthetic, write_examples

    return write_examples(make_synthetic(2, num_words=20, seed=0), p)


def _data_root(root: Path, eval_50: bytes | None = None) -> Path:
    """A data root as memagent-prepare leaves it: eval_50's converted file (`eval_50`, else two good
    rows) and a manifest recording its size."""
    f = root / 'eval_50.jsonl'
    _records(f) if eval_50 is None else _write(f, eval_50, True)
    entry = {'converted': {'path': f.name, 'bytes': f.stat().st_size}}
    _write(
        root / 'manifest.json',
        json.dumps({'kind': 'memagent.data.prepare', 'files': {'eval_50.json': entry}}).encode(),
    )
    return root


_TRAIN = lambda t: {
    'preset': 'tiny',
    'run': 'r',
    'out_dir': str(t / 'runs'),
    'report_dir': str(t / 'reports'),
}
_ACCEPTANCE = lambda t: {
    'preset': 'tiny',
    'base_model': 'tiny-qwen3',
    'reference_model': 'tiny-qwen3',
    'candidate_model': 'tiny-qwen3',
    'eval_data': 'pinned',
    'lengths': [50],
    'hotpotqa': False,
    'run_name': 'r',
    'out_root': str(t / 'acc'),
}


def _jsonl(param):
    """A run notebook's data parameter given a JSONL file of the bad bytes: `[(what, parameters, the
    bad file)]`."""

    def cases(t: Path, bad: bytes):
        f = _write(t / 'in' / f'{param}.jsonl', bad, True)
        return [(param, {**_TRAIN(t), param: str(f)}, f)]

    return cases


def _pinned_root(t: Path, bad: bytes):
    """acceptance's data_root (eval_data='pinned'): the root's manifest is the bad file, then one
    data file its manifest names."""
    r1, r2 = _data_root(t / 'root1'), _data_root(t / 'root2', bad)
    _write(r1 / 'manifest.json', bad)
    return [
        (
            "the root's manifest.json",
            {**_ACCEPTANCE(t), 'data_root': str(r1)},
            r1 / 'manifest.json',
        ),
        (
            'a data file the manifest names',
            {**_ACCEPTANCE(t), 'data_root': str(r2)},
            r2 / 'eval_50.jsonl',
        ),
    ]


def _receipt(name, checkout=False):
    """A verify-mode notebook given a copy of its committed report folder whose receipt.json is the
    bad file."""

    def cases(t: Path, bad: bytes):
        # the notebook finds the repository from the working folder even in verify mode: this folder
        # stands in for it
        if checkout:
            shutil.copy(ROOT / 'settings.ini', t / 'cwd' / 'settings.ini')
            (t / 'cwd' / 'data' / 'parity').mkdir(parents=True)
            (t / 'cwd' / 'data' / 'parity' / 'fixtures.jsonl').symlink_to(
                ROOT / 'data' / 'parity' / 'fixtures.jsonl'
            )
        rep = t / 'report'
        shutil.copytree(ROOT / 'reports' / name, rep)
        return [
            (
                'receipt.json',
                {'mode': 'verify', 'report_dir': str(rep)},
                _write(rep / 'receipt.json', bad),
            )
        ]

    return cases


INPUT_PARAMS = {  # notebook -> {parameter: the cases giving it a bad file}
    'train': {'train_data': _jsonl('train_data'), 'eval_data': _jsonl('eval_data')},
    'smoke': {'data': _jsonl('data')},
    'acceptance': {'data_root': _pinned_root},
    'agemem_audit': {'report_dir': _receipt('agemem_audit')},
    'agemem_observed': {'report_dir': _receipt('agemem_observed')},
    'agemem_advantages': {
        'report_dir': _receipt('agemem_advantages')
    },  # before its run: the folder's inputs and the bad receipt
    'parity': {'report_dir': _receipt('parity', checkout=True)},
    'loss_parity': {'report_dir': _receipt('loss_parity', checkout=True)},
}
# read receipt.json through their verifiers, every cell run
VERIFY_MODE = {
    'agemem_audit',
    'agemem_observed',
    'agemem_advantages',
    'parity',
    'loss_parity',
}
NO_INPUT_FILES = {
    'bench': (
        'a model name (resolved by memagent.models), presets and workloads it builds; no '
        'parameter names a JSON, JSONL or YAML file'
    ),
    'rehearsal': (
        "haystacks built from the package's shipped HotpotQA sample; no parameter names a file"
    ),
    'simulate': (
        'a simulation from seeds, lengths and latency fields given as values; reads no file'
    ),
    'launch': 'a simulated node from numbers and mode names; reads no file',
    'plan': 'a memory plan from a preset, overrides and numbers; reads no file',
    'gpu_check': (
        'out is the folder it writes; its parts build their inputs; no parameter names a file it '
        'reads'
    ),
}
# (notebook, case) pairs that still fail, each with its reason, marked xfail(strict) until fixed
KNOWN = {}


def test_every_run_notebook_declares_its_input_files():
    """A new run notebook fails here until its input-file parameters are listed in INPUT_PARAMS, or
    it is declared without any."""
    assert not set(INPUT_PARAMS) & set(NO_INPUT_FILES)
    assert set(INPUT_PARAMS) | set(NO_INPUT_FILES) == set(RUN_NOTEBOOKS), set(RUN_NOTEBOOKS) ^ (
        set(INPUT_PARAMS) | set(NO_INPUT_FILES)
    )


@pytest.mark.parametrize(
    'name,param,case',
    [
        pytest.param(
            n,
            p,
            c,
            marks=[pytest.mark.xfail(strict=True, reason=KNOWN[n, c])] if (n, c) in KNOWN else [],
        )
        for n in INPUT_PARAMS
        for p in INPUT_PARAMS[n]
        for c in BAD
    ],
)
def test_every_run_notebook_refuses_a_bad_input_file_naming_it(
    tmp_path, monkeypatch, name, param, case
):
    """The bad bytes as one input of a run notebook, run in this process: the check cell (a
    verify-mode notebook: every cell)
        raises `FileError` naming the file and the parameter (a verifier: its `VerificationError`
        naming
        the file), and writes nothing."""
    from memagent.files import FileError
    from memagent.testing import run_notebook_cells

    (tmp_path / 'cwd').mkdir()
    for what, params, bad_file in INPUT_PARAMS[name][param](tmp_path, BAD[case]):
        before = _tree(tmp_path)
        # anything written by mistake lands under tmp_path, and is caught below
        monkeypatch.chdir(tmp_path / 'cwd')
        _, err = run_notebook_cells(
            ROOT / 'nbs' / f'{name}.ipynb', params, cells=None if name in VERIFY_MODE else 1
        )
        said = str(err)
        if name in VERIFY_MODE:
            assert type(err).__name__ == 'VerificationError', (name, what, repr(err)[-500:])
        else:
            assert isinstance(err, FileError) and f'parameter {param}: ' in said, (
                name,
                what,
                repr(err)[-500:],
            )
        assert str(bad_file) in said, (name, what, said[-500:])
        assert _tree(tmp_path) == before, (name, what, 'something was written')


def _aliased(t: Path):
    """`(notebook, input parameter, output folder, parameters)`: an input inside a folder the run
    writes, spelt through a symlink, '..' and a hard link."""
    places = [
        ('train', 'train_data', t / 'runs' / 'r', _TRAIN(t)),
        ('train', 'eval_data', t / 'reports' / 'r', _TRAIN(t)),
        ('smoke', 'data', t / 'runs' / 'r', _TRAIN(t)),
        ('smoke', 'data', t / 'reports' / 'r', _TRAIN(t)),
        ('acceptance', 'data_root', t / 'acc' / 'r', _ACCEPTANCE(t)),
    ]
    (t / 'x').mkdir()
    for i, (name, param, folder, base) in enumerate(places):
        real = (
            _data_root(folder / f'root{i}')
            if param == 'data_root'
            else _records(folder / 'in' / f'd{i}.jsonl')
        )
        (t / f'link{i}').symlink_to(folder)
        rel = real.relative_to(folder)
        if param == 'data_root':
            hard = t / f'hard{i}'
            hard.mkdir()
            for f in real.iterdir():
                os.link(f, hard / f.name)
        else:
            hard = t / f'hard{i}.jsonl'
            os.link(real, hard)
        for how, p in (
            ('a symlink', t / f'link{i}' / rel),
            ("'..'", t / 'x' / '..' / real.relative_to(t)),
            ('a hard link', hard),
        ):
            yield name, param, folder, {**base, param: str(p)}, how


def test_run_notebooks_refuse_an_input_inside_an_output_folder(tmp_path, monkeypatch):
    """train, smoke and acceptance: an input inside a folder the run writes or replaces, however
    spelt, is refused by the check cell naming the parameter and the folder; nothing is written."""
    from memagent.testing import run_notebook_cells

    (tmp_path / 'cwd').mkdir()
    cases = list(_aliased(tmp_path))
    monkeypatch.chdir(tmp_path / 'cwd')
    before = _tree(tmp_path)
    for name, param, folder, params, how in cases:
        _, err = run_notebook_cells(ROOT / 'nbs' / f'{name}.ipynb', params, cells=1)
        assert (
            isinstance(err, ValueError)
            and f'parameter {param}' in str(err)
            and str(folder) in str(err)
        ), (name, param, how, repr(err)[-500:])
        assert _tree(tmp_path) == before, (name, param, how, 'something was written')


def test_every_console_tool_helps_outside_a_checkout(tmp_path, monkeypatch):
    """`--help` of every console script works in a folder that is no checkout: what a tool needs
    from the repository is an option."""
    monkeypatch.chdir(tmp_path)
    for name, target in console_scripts().items():
        rc, said = _call(target, ['--help'])
        assert rc == 0 and 'usage:' in said and 'Traceback' not in said, (name, rc, said[-300:])
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_cannot_be_written_leaves_nothing(tmp_path):
    """An output whose folder cannot be made (here: a file stands where the folder would be, which
    stops root as well as a
        read-only folder stops a user) is refused with exit 2 before any output is in place: convert
        leaves no data file without
        its manifest, compare no report."""
    import json
    from memagent.data import load_hotpotqa

    pool = tmp_path / 'pool.jsonl'
    pool.write_text(''.join(json.dumps(r) + '\n' for r in load_hotpotqa(limit=3)))
    (tmp_path / 'blocker').write_text('a file, not a folder')
    scripts = console_scripts()
    before = _tree(tmp_path)
    rc, said = _call(
        scripts['memagent-convert'],
        [
            str(pool),
            str(tmp_path / 'out.jsonl'),
            '--manifest',
            str(tmp_path / 'blocker' / 'm.json'),
        ],
    )
    assert rc == 2 and 'Traceback' not in said and _tree(tmp_path) == before, (rc, said[-400:])
    for r in ('c', 'r', 'b'):
        (tmp_path / r).mkdir()
        (tmp_path / r / 'summary.json').write_text('{}')
    before = _tree(tmp_path)
    rc, said = _call(
        scripts['memagent-compare'],
        [
            '--candidate',
            str(tmp_path / 'c'),
            '--reference',
            str(tmp_path / 'r'),
            '--base',
            str(tmp_path / 'b'),
            '--out',
            str(tmp_path / 'blocker' / 'cmp.json'),
        ],
    )
    assert rc == 2 and 'Traceback' not in said and _tree(tmp_path) == before, (rc, said[-400:])
