"""The GPU install (scripts/setup_gpu.sh) and its lock (requirements/gpu-linux-x86_64-py311.txt)
agree with settings.ini, name
Transformer Engine inside megatron-core's range, and install in order: torch, the gpu extra, TE.
Fast: no network, no resolution."""

import configparser, os, re, shutil, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / 'requirements' / 'gpu-linux-x86_64-py311.txt'
SETUP_GPU = ROOT / 'scripts' / 'setup_gpu.sh'
LOCK_SH = ROOT / 'scripts' / 'lock_gpu.sh'


def _ini(key):
    c = configparser.ConfigParser(delimiters=['='])
    c.read(ROOT / 'settings.ini', encoding='utf-8')
    return c['DEFAULT'][key].split()


def _var(name):
    "A `NAME=value` assignment at the start of a line of setup_gpu.sh."
    m = re.search(rf'^{name}=(\S+)', SETUP_GPU.read_text(), re.M)
    assert m, f"scripts/setup_gpu.sh assigns no {name}"
    return m.group(1)


def _canon(n):
    return re.sub(r'[-_.]+', '-', n).lower()


def _entries():
    "The lock's requirements: canonical name -> (version, hashes)."
    out, cur = {}, None
    for line in LOCK.read_text().splitlines():
        if m := re.match(r'^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)', line):
            cur = _canon(m.group(1))
            out[cur] = (m.group(3), [])
        elif cur and (h := re.search(r'--hash=sha256:([0-9a-f]{64})', line)):
            out[cur][1].append(h.group(1))
        elif line.strip() and not line.lstrip().startswith('#'):
            assert line.startswith(' ') or line.endswith('\\'), (
                f"lock line is not a pinned requirement: {line!r}"
            )
    return out


def _pins(reqs):
    return {
        _canon(m.group(1)): m.group(2)
        for r in reqs
        if (m := re.fullmatch(r'([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==(\S+)', r))
    }


def _dry_run(**env):
    e = {**os.environ, 'PYTHON': sys.executable, **env}
    return subprocess.run(
        ['bash', str(SETUP_GPU), '--dry-run'],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=e,
    )


def test_every_lock_line_pinned_and_hashed():
    ents = _entries()
    assert len(ents) > 50
    assert not [n for n, (v, hs) in ents.items() if not hs], "requirements without a hash"
    # an sdist built against torch: pinned in setup_gpu.sh instead
    assert 'transformer-engine-torch' not in ents


def test_lock_agrees_with_settings_and_setup_gpu():
    ents = _entries()
    gpu = _pins(_ini('gpu_requirements'))
    assert set(gpu) >= {'sglang', 'megatron-core'}, (
        "settings.ini gpu_requirements pins sglang and megatron-core exactly"
    )
    for n, v in gpu.items():
        assert ents[n][0] == v, (n, v, ents[n][0])
    assert (
        _pins(_ini('dev_requirements')).get('megatron-core', gpu['megatron-core'])
        == gpu['megatron-core']
    )
    name, ver = _var('TORCH_PIN').split('==')
    assert name == 'torch' and ents['torch'][0] == ver
    te = _var('TE_VERSION')
    assert ents['transformer-engine'][0] == te and ents['transformer-engine-cu13'][0] == te
    for d in _var('TE_TORCH_DEPS').split(','):
        assert _canon(d) in ents, d
    assert re.fullmatch(r'[0-9a-f]{64}', _var('TE_TORCH_SDIST_SHA256'))


def test_lock_header_names_its_command_and_input():
    text = LOCK.read_text()
    head = [l for l in text.splitlines() if l.startswith('#')][:40]
    h = '\n'.join(head)
    assert 'bash scripts/lock_gpu.sh' in h
    for flag in (
        'uv pip compile',
        '--python-platform x86_64-manylinux_2_34',
        '--python-version 3.11',
        '--generate-hashes',
    ):
        assert flag in h and flag in LOCK_SH.read_text(), flag
    want = []
    for r in (
        *_ini('requirements'),
        *_ini('dev_requirements'),
        *_ini('gpu_requirements'),
        _var('TORCH_PIN'),
        f"transformer-engine[core_cu13]=={_var('TE_VERSION')}",
        *_var('TE_TORCH_DEPS').split(','),
    ):
        if r not in want:
            want.append(r)
    got = [l[4:] for l in head if l.startswith('#   ') and not l.startswith('#   uv ')]
    assert got == want, (
        "the lock's input differs from settings.ini / setup_gpu.sh: run bash scripts/lock_gpu.sh"
    )


def test_no_index_named():
    for f in (LOCK, SETUP_GPU, LOCK_SH):
        t = f.read_text()
        assert '://' not in t, f
        assert not re.search(
            r'^\s*(-i|--index-url|--extra-index-url|-f|--find-links)\b', t, re.M
        ), f
        assert not re.search(r'--(extra-)?index-url[ =]', t), f


def test_te_inside_megatron_range():
    from memagent.doctor import _in, dist_version, requirement_spec

    mc = _pins(_ini('gpu_requirements'))['megatron-core']
    if dist_version('megatron-core') != mc:
        pytest.skip(f"megatron-core {mc} is not installed here")
    rng = requirement_spec('megatron-core', 'transformer-engine')
    assert rng, "megatron-core declares no transformer-engine range"
    assert _in(rng, _var('TE_VERSION')), (rng, _var('TE_VERSION'))


def test_dry_run_order_and_early_checks():
    r = _dry_run()
    out = r.stdout
    assert r.returncode == 0, r.stdout + r.stderr
    te = _var('TE_VERSION')
    marks = [
        '== 0/4 early checks',
        f"TORCH_SPEC={_var('TORCH_PIN')} bash scripts/setup.sh",
        '== 2/4 the gpu extra',
        "--require-hashes -r",
        "-e '.[gpu]'",
        '== 3/4 Transformer Engine',
        '--no-build-isolation',
        f"transformer-engine-torch=={te} --hash=sha256:{_var('TE_TORCH_SDIST_SHA256')}",
        '== 4/4 checks',
        'pip check',
    ]
    at = [out.find(m) for m in marks]
    assert all(i >= 0 for i in at), [m for m, i in zip(marks, at) if i < 0]
    assert at == sorted(at), (
        "setup_gpu.sh installs torch, then the gpu extra, then Transformer Engine"
    )
    te_line = next(l for l in out.splitlines() if '--no-build-isolation' in l)
    assert f"transformer-engine-torch=={te}" in te_line and '/^transformer-engine/' in te_line
    assert 'nothing was installed' in out
    # the doctor's own row, printed as a warning in a dry run
    if shutil.which('nvidia-smi') is None:
        assert (
            re.search(r'^CUDA driver +FAIL +no NVIDIA driver answered', out, re.M)
            and 'WARN (dry run) memagent-doctor: a row above fails' in out
        ), out


def test_real_run_stops_before_installing(tmp_path):
    if shutil.which('nvidia-smi') is not None:
        pytest.skip('a machine with a driver: the install would start')
    venv = tmp_path / 'venv'
    r = subprocess.run(
        ['bash', str(SETUP_GPU), str(venv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, 'PYTHON': sys.executable},
    )
    assert (
        r.returncode == 1
        and re.search(r'^CUDA driver +FAIL', r.stdout, re.M)
        and 'stopping before any install' in r.stdout
    ), r.stdout + r.stderr
    assert 'scripts/setup.sh' not in r.stdout
    assert not venv.exists(), (
        'the early checks failed, yet the venv was made (the bootstrap belongs in a throwaway '
        'folder)'
    )
