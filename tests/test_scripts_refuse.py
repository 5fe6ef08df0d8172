"""The shell and Python scripts refuse bad input before they write, and clean up after a failure:
scripts/lock_gpu.sh when
uv fails, scripts/setup.sh given a folder or file that is not a virtual environment,
scripts/probes.py given bad
arguments or a report folder it may not write. Each test simulates the machine (a failing tool on
PATH, a folder that is
there already, a tree that differs from HEAD), runs the real script and compares the tree before and
after."""

import os, shutil, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tree(d: Path, skip=('.git',)) -> dict:
    """Every file under `d` (outside `skip`) -> its bytes; a folder -> None, so an added empty
    folder shows too."""
    return {
        str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(d.rglob('*'))
        if not set(p.relative_to(d).parts) & set(skip)
    }


def _stub(bin_dir: Path, name: str, body: str) -> Path:
    """An executable `name` in `bin_dir` running the shell `body`: the tool as a machine would have
    it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    p = bin_dir / name
    p.write_text('#!/bin/sh\n' + body + '\n')
    p.chmod(0o755)
    return p


# ---- scripts/lock_gpu.sh: uv fails -> no requirements/*.tmp, the lock unchanged ----


def test_lock_gpu_cleans_its_temporaries_when_uv_fails(tmp_path):
    """A copy of the script with the files it reads; uv on PATH exits 1 (no index reachable): exit
    non-zero, requirements/ byte-identical, no *.tmp."""
    repo = tmp_path / 'repo'
    (repo / 'scripts').mkdir(parents=True)
    (repo / 'requirements').mkdir()
    for f in ('scripts/lock_gpu.sh', 'scripts/setup_gpu.sh', 'settings.ini'):
        shutil.copy(ROOT / f, repo / f)
    for f in (ROOT / 'requirements').iterdir():
        shutil.copy(f, repo / 'requirements' / f.name)
    _stub(tmp_path / 'bin', 'uv', 'echo "uv: no index could be reached" >&2; exit 1')
    before = _tree(repo)
    r = subprocess.run(
        ['bash', str(repo / 'scripts' / 'lock_gpu.sh')],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, 'PATH': f"{tmp_path / 'bin'}:{os.environ['PATH']}"},
    )
    assert r.returncode != 0, r.stdout + r.stderr
    assert (
        'no index could be reached' in r.stderr
        and 'requirements/gpu-linux-x86_64-py311.txt is unchanged' in r.stderr
    ), r.stderr
    assert not list(repo.rglob('*.tmp')), list(repo.rglob('*.tmp'))
    assert _tree(repo) == before


# ---- scripts/setup.sh DIR: refused before any python/venv/pip call unless DIR is a venv, an empty
# folder or absent ----


def _setup(venv, tmp_path):
    """setup.sh DIR with PYTHON a stub that records its calls and fails (so nothing is installed
    either way); (process, calls)."""
    calls = tmp_path / 'calls.txt'
    py = _stub(tmp_path / 'bin', 'python-stub', f'echo "$@" >>{calls}; exit 1')
    r = subprocess.run(
        ['bash', str(ROOT / 'scripts' / 'setup.sh'), str(venv)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, 'PYTHON': str(py)},
    )
    return r, (calls.read_text() if calls.exists() else '')


@pytest.mark.parametrize('kind', ['folder with other files', 'regular file'])
def test_setup_refuses_a_dir_that_is_not_a_venv_before_writing(tmp_path, kind):
    work = tmp_path / 'work'
    work.mkdir()
    target = work / 'target'
    if kind == 'regular file':
        target.write_text('notes\n')
    else:
        target.mkdir()
        (target / 'notes.txt').write_text('mine\n')
        (target / 'sub').mkdir()
    before = _tree(work)
    r, calls = _setup(target, tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(target) in r.stderr and 'not a virtual environment' in r.stderr, r.stderr
    assert ('is a file' if kind == 'regular file' else 'it holds: notes.txt sub') in r.stderr, (
        r.stderr
    )
    assert calls == '', f"python was called before the refusal: {calls}"
    assert _tree(work) == before


@pytest.mark.parametrize('kind', ['existing venv', 'empty folder', 'absent'])
def test_setup_accepts_a_venv_an_empty_folder_or_a_new_path(tmp_path, kind):
    """Past the check the first call is `python -m venv DIR`, as before (the stub fails it, so
    nothing is installed)."""
    target = tmp_path / 'target'
    if kind != 'absent':
        target.mkdir()
    if kind == 'existing venv':
        (target / 'pyvenv.cfg').write_text('home = /usr/bin\n')
        (target / 'bin').mkdir()
    r, calls = _setup(target, tmp_path)
    assert calls.splitlines() == [f'-m venv {target}'], r.stdout + r.stderr
    assert 'not a virtual environment' not in r.stderr


# ---- scripts/probes.py: bad arguments and a report folder it may not write are refused before
# anything is written ----


def _probes(script, *args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


@pytest.mark.parametrize(
    'args,says',
    [
        (['--only', 'no-such-variant'], "invalid choice: 'no-such-variant'"),
        (['--only'], '--only names no variant'),
        (['--steps', '0'], '--steps 0: must be a positive integer'),
        (['--collect'], '--collect: no runs folder'),
    ],
    ids=['unknown variant', 'empty --only', 'zero steps', 'collect without runs'],
)
def test_probes_refuses_bad_arguments_before_writing(tmp_path, args, says):
    runs, out = tmp_path / 'runs', tmp_path / 'out'
    before = _tree(tmp_path)
    r = _probes(ROOT / 'scripts' / 'probes.py', '--runs', str(runs), '--out', str(out), *args)
    assert r.returncode == 2 and says in r.stderr, r.stdout + r.stderr
    assert _tree(tmp_path) == before and not runs.exists() and not out.exists()


def test_probes_refuses_a_report_in_reports_of_an_unclean_tree(tmp_path):
    """A repository holding the script whose tracked source differs from HEAD: --out under its
    reports/ refused naming the file; nothing written."""
    repo = tmp_path / 'repo'
    (repo / 'scripts').mkdir(parents=True)
    (repo / 'reports').mkdir()
    shutil.copy(ROOT / 'scripts' / 'probes.py', repo / 'scripts' / 'probes.py')
    (repo / 'settings.ini').write_text('[DEFAULT]\n')
    (repo / 'reports' / 'keep.md').write_text('# kept\n')
    g = lambda *a: subprocess.run(['git', '-C', str(repo), *a], check=True, capture_output=True)
    g('init', '-q')
    g('add', '.')
    g('-c', 'user.email=t@t', '-c', 'user.name=t', 'commit', '-qm', 'a')
    (repo / 'settings.ini').write_text('[DEFAULT]\n# edited\n')
    before = _tree(repo)
    r = _probes(
        repo / 'scripts' / 'probes.py', '--out', str(repo / 'reports' / 'probes' / 'x'), cwd=repo
    )
    assert (
        r.returncode == 2
        and "probes.py --out" in r.stderr
        and "under the repository's reports/" in r.stderr
    ), r.stderr
    assert 'settings.ini' in r.stderr, r.stderr
    assert _tree(repo) == before and not (repo / 'runs').exists()
