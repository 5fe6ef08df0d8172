"""The launch a user gets on a GPU node, exercised on a simulated node (Ray with declared GPUs and
CPUs, SGLang's launch
command served by the schema server): Ray joined or started through `ensure_ray`, layouts a cluster
cannot hold refused
at once, one distinct GPU per rank, engines on their ranks' GPUs, and the launch report rendered
from both launches.
Every Ray in this file runs in a child process started in the node's environment; this process never
starts Ray."""

import json, os, subprocess, sys, time
from pathlib import Path
import pytest
from memagent.simnode import SimulatedNode, marked_pids

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(1500)


def _child(code: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope='module')
def node():
    n = SimulatedNode(gpus=8, cpus=16).start()
    yield n
    d = n.dir
    n.stop()
    assert marked_pids(str(d)) == [], 'processes of the simulated node survived its stop'


JOIN = """
import json
from memagent.transfer import ensure_ray
r = ensure_ray()
c = r.cluster_resources()
print(json.dumps({'gpus': c.get('GPU'), 'cpus': c.get('CPU'), 'gcs': r.get_runtime_context().gcs_address}))
"""  # noqa: E501


def test_joins_the_cluster_named_by_RAY_ADDRESS(node):
    """RAY_ADDRESS set (only in the driver's environment): ensure_ray joins, passing no resources
    (Ray would refuse them)."""
    assert 'RAY_ADDRESS' not in os.environ
    r = _child(JOIN, node.child_env(join=True))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert (got['gpus'], got['cpus']) == (8.0, 16.0) and got['gcs'].endswith(
        node.address.rsplit(':', 1)[1]
    )


def test_joins_the_cluster_a_ray_start_recorded(node):
    """No RAY_ADDRESS, but `ray start` on this node recorded its cluster in Ray's temporary
    directory: joined, as ray.init would."""
    env = node.child_env(join=False)
    env['RAY_TMPDIR'] = str(node.dir)  # Ray's temp dir is $RAY_TMPDIR/ray: the node's private one
    assert (node.dir / 'ray' / 'ray_current_cluster').is_file()
    r = _child(JOIN, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])['gpus'] == 8.0
    r = _child("from memagent.transfer import ensure_ray; ensure_ray(num_cpus=2)", env)
    assert r.returncode != 0 and 'takes no num_cpus/num_gpus' in r.stderr, r.stderr[-2000:]


def test_a_layout_the_cluster_cannot_hold_is_refused_at_once():
    """Ray started with 2 CPUs and 8 GPUs cannot place 8 bundles of {GPU: 1, CPU: 1}: refused in
    seconds, naming the numbers, not after a 300 s wait."""
    code = """
import time
from memagent.transfer import ensure_ray
from memagent.colocate import Placement
ensure_ray(num_cpus=2, num_gpus=8)
t0 = time.monotonic()
try: Placement(8, 2)
except Exception as e: print(type(e).__name__, round(time.monotonic() - t0, 1)); print(e)
"""
    import shutil, tempfile

    # short: Ray's socket paths must stay under 108 bytes
    tmp = tempfile.mkdtemp(prefix='rt-', dir='/tmp')
    env = {k: v for k, v in os.environ.items() if k not in ('RAY_ADDRESS', 'CUDA_VISIBLE_DEVICES')}
    # no `ray start` record there: Ray is started, not joined
    env.update(RAY_TMPDIR=tmp, PYTHONPATH=str(ROOT))
    try:
        r = _child(code, env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    kind, secs = r.stdout.splitlines()[0].split()
    assert kind == 'ClusterError' and float(secs) < 10, r.stdout
    assert 'needs GPU 8, CPU 8' in r.stdout and 'short: CPU 8 > 2' in r.stdout, r.stdout


# four or more Ray ranks: the machine's every core, so it runs alone (scripts/test.sh)
@pytest.mark.exclusive
def test_launch_report_both_launches(tmp_path):
    """The launch notebook on a fresh simulated node: the frozen layout (TP 2 x DP 4, tiny model,
    the named overrides)
        through the trainer's own path to its first rollout, colocated (joined through RAY_ADDRESS)
        and
        with separate servers
        (Ray started by the trainer); every rank one distinct GPU, each engine its ranks' GPUs,
        NOSET
        shown by probes."""
    out = tmp_path / 'launch.ipynb'
    r = subprocess.run(
        [
            sys.executable,
            '-m',
            'papermill',
            str(ROOT / 'nbs/launch.ipynb'),
            str(out),
            '-p',
            'run',
            'test',
            '-p',
            'out_root',
            str(tmp_path / 'reports'),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rep = json.loads((tmp_path / 'reports/test/launch.json').read_text())
    assert rep['passed'] is True and set(rep['launches']) == {'colocated', 'separate'}
    assert rep['overrides'] == {
        'model.name': 'tiny-qwen3',
        'batch.sequence_parallel': False,
        'batch.distributed_optimizer': False,
    }
    assert rep['switch'] == {'simulated_gpus': True}
    for mode, L in rep['launches'].items():
        gpus = [x['ray_gpu_ids'] for x in L['ranks']]
        assert len(L['ranks']) == 8 and len(set(gpus)) == 8 and all(',' not in g for g in gpus), (
            mode,
            gpus,
        )
        assert sorted((x['DP'], x['TP']) for x in L['ranks']) == [
            (d, t) for d in range(4) for t in range(2)
        ]
        assert all(
            x['CUDA_VISIBLE_DEVICES'] == x['ray_gpu_ids'] and x['torch_device_index'] == 0
            for x in L['ranks']
        )
        assert (
            L['rollout']['trajectories'] == L['rollout']['ok'] == 64
            and L['rollout']['requests'] > 0
        )
        assert L['ray_address_joined'] == (mode == 'colocated')
    co = rep['launches']['colocated']
    by_rank = {x['rank']: x for x in co['ranks']}
    assert [e['GPUs_seen_by_the_server'] for e in co['engines']] == [
        f"{by_rank[2 * e]['ray_gpu_ids']},{by_rank[2 * e + 1]['ray_gpu_ids']}" for e in range(4)
    ]
    assert all(e['tp_size'] == 2 and e['mem_fraction'] == 0.7 for e in co['engines'])
    noset = [p for p in rep['noset_probe'] if p['NOSET']]
    assert len(noset) == 8 and sorted(p['torch_device_index'] for p in noset) == list(range(8))
    assert all(all(c.values()) for c in rep['checks'].values())
    assert (tmp_path / 'reports/test/README.md').read_text().count('| rank |') == 2


def test_the_frozen_preset_without_transformer_engine_stops_before_ray(tmp_path):
    """Sequence parallel without Transformer Engine: the trainer's doctor rows refuse it in seconds,
    naming the row and the fix, before Ray starts or anything is written."""
    code = f"""
import time
t0 = time.monotonic()
from memagent.config import get_preset
from memagent.data import make_synthetic
from memagent.doctor import DoctorError
from memagent.trainer import Trainer
try: Trainer(get_preset('qwen3-4b-frozen', {{'model.name': 'tiny-qwen3'}}), {str(tmp_path / 'run')!r}, make_synthetic(2, num_words=30), world_size=8)
except DoctorError as e:
    import ray
    print('refused', round(time.monotonic() - t0, 1), ray.is_initialized()); print(e)
"""  # noqa: E501
    r = _child(code, {k: v for k, v in os.environ.items() if k != 'RAY_ADDRESS'})
    assert r.returncode == 0, r.stderr[-3000:]
    head, msg = r.stdout.split('\n', 1)
    _, secs, ray_up = head.split()
    assert float(secs) < 30 and ray_up == 'False', head
    assert (
        'Transformer Engine: found transformer-engine is not installed' in msg
        and 'batch.sequence_parallel' in msg
        and 'fix:' in msg
    ), msg
    assert not (tmp_path / 'run').exists()
