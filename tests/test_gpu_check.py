"""scripts/gpu_check.sh on a machine without a GPU: --dry-run shows every command and the plans; a real run refuses."""
import json, os, subprocess, sys
from pathlib import Path
import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, 'PYTHON': sys.executable}


def _run(*args):
    return subprocess.run(['bash', 'scripts/gpu_check.sh', *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def test_dry_run_prints_every_command_and_the_plans(tmp_path):
    r = _run('--dry-run', '--out', str(tmp_path / 'gpu'))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert f"+ {sys.executable} scripts/gpu_check.py subset --out {tmp_path}/gpu/subset" in out
    assert f"+ {sys.executable} -m papermill nbs/smoke.ipynb {tmp_path}/gpu/smoke.ipynb -f {tmp_path}/gpu/smoke_params.yaml" in out
    assert f"scripts/gpu_check.py compare --params {tmp_path}/gpu/smoke_params.yaml --gpus 8" in out
    assert out.count('plan of ') == 2 and out.count('GiB per GPU') == 2      # the subset's plan and the cluster's
    assert not (tmp_path / 'gpu').exists()                                    # a dry run writes nothing


def test_smoke_parameters_are_the_smoke_notebooks(tmp_path):
    sys.path.insert(0, str(ROOT / 'scripts'))
    try:
        import gpu_check
        p = gpu_check.smoke_params('none', 8)
    finally: sys.path.remove(str(ROOT / 'scripts'))
    nb = json.loads((ROOT / 'nbs' / 'smoke.ipynb').read_text())
    cell = next(c for c in nb['cells'] if 'parameters' in c.get('metadata', {}).get('tags', []))
    names = {line.split('=')[0].strip() for line in ''.join(cell['source']).splitlines() if '=' in line and not line.startswith(' ')}
    assert set(p) <= names, set(p) - names
    from memagent.config import get_preset
    cfg = get_preset(p['preset'], p['overrides'])                 # the overrides validate
    assert cfg.rollout.colocate and cfg.batch.n_gpus == 8 and cfg.backend == 'megatron'
    assert yaml.safe_load(yaml.safe_dump(p)) == p


def test_a_real_run_without_a_gpu_refuses():
    r = _run('--part', 'subset')
    assert r.returncode == 2 and 'no CUDA device here' in r.stderr


def test_unknown_argument_is_named():
    r = _run('--dryrun')
    assert r.returncode == 2 and "unknown argument '--dryrun'" in r.stderr
