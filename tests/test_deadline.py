"""The data-parallel update's deadline follows progress: a slow rank that keeps finishing
micro-batches is never
stopped, a stalled rank is named within the stall timeout plus a small bound; ranks follow a given
placement.

A rank is made slow or stalled by a torch backend defined here, registered as `BACKENDS['torch']` in
every Ray worker of this module's Ray session (a worker setup hook); it reads what to do from a JSON
file the tests write."""

import json, os, sys, time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
SPEC_ENV = 'MEMAGENT_DEADLINE_TEST_SPEC'

from memagent.backends.torch import TorchBackend

pytestmark = pytest.mark.timeout(240)


class SlowTorchBackend(TorchBackend):
    """The torch backend, delayed after each backward on the rank the spec names; `stall_at`: that
    backward never ends."""

    def backward(self, loss):
        super().backward(loss)
        spec = json.loads(Path(os.environ[SPEC_ENV]).read_text())
        if self.dp_rank != spec['rank']:
            return
        self.calls = getattr(self, 'calls', 0) + 1
        time.sleep(3600 if self.calls == spec.get('stall_at') else spec.get('delay', 0.0))


def register_slow_backend():
    "Ray worker setup hook: the config's 'torch' backend is the slow one in this session's workers."
    import memagent.policy

    memagent.policy.BACKENDS['torch'] = 'test_deadline:SlowTorchBackend'


@pytest.fixture(scope='module')
def ray_session(tmp_path_factory):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    spec = tmp_path_factory.mktemp('deadline') / 'spec.json'
    spec.write_text(json.dumps({'rank': -1}))
    pp = os.pathsep.join([str(ROOT), str(HERE), os.environ.get('PYTHONPATH', '')])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=1 << 28,
        log_to_driver=False,
        runtime_env={
            'env_vars': {'PYTHONPATH': pp, 'RAY_USAGE_STATS_ENABLED': '0', SPEC_ENV: str(spec)},
            'worker_process_setup_hook': 'test_deadline.register_slow_backend',
        },
    )
    yield ray, spec
    ray.shutdown()


def _cfg(stall):
    from memagent.config import get_preset

    return get_preset(
        'tiny',
        {
            'grpo.prompts_per_step': 4,
            'optim.mini_batches': 2,
            'loss.kl_coef': 0.0,
            'batch.max_tokens_per_micro': 320,
            'health.stall_timeout_s': stall,
        },
    )


def _put_step(channel, step, cfg):
    """8 rows of 200 tokens in 4 groups, laid out for 2 ranks and 2 mini-batches: 2 micro-batches
    per mini-batch per rank."""
    from memagent.trajectory import Row
    from memagent.transfer import layout_step

    rows = [
        Row(
            f'g{g}#{s}',
            g,
            0,
            1,
            float(s),
            1.0 - 2 * s,
            1.0 - 2 * s,
            0.25,
            [1 + (i % 50) for i in range(190 + g)],
            [3 + s] * 10,
            [-4.0] * 10,
            [1] * 10,
        )
        for g in range(4)
        for s in range(2)
    ]
    laid, pad = layout_step(rows, 2, cfg.optim.mini_batches)
    assert pad == 0
    channel.put(step, laid)


class Placement:
    "A stand-in for memagent.colocate's placement: rank r in bundle r of a CPU placement group."

    def __init__(self, pg):
        self.pg, self.asked = pg, []

    def train_options(self, rank):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.asked.append(rank)
        return {
            'scheduling_strategy': PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=rank
            )
        }


@pytest.fixture(scope='module')
def placed(ray_session):
    from ray.util.placement_group import placement_group, remove_placement_group
    from memagent.colocate import make_group

    ray, _ = ray_session
    pg = placement_group([{'CPU': 1}, {'CPU': 1}])
    ray.get(pg.ready(), timeout=60)
    place = Placement(pg)
    g = make_group(_cfg(3.0), 0, world_size=2, placement=place)
    yield g, place, pg
    g.close()
    remove_placement_group(pg)


def test_ranks_follow_the_placement(placed):
    g, place, pg = placed
    assert place.asked == [0, 1]
    assert [l['placement_group'] for l in g.layouts] == [pg.id.hex()] * 2


def test_slow_but_progressing_rank_is_not_stopped(placed, ray_session):
    from memagent.transfer import RayChannel

    g, _, _ = placed
    _, spec = ray_session
    cfg = g.cfg
    # 4 backwards x 1.2 s on rank 1; every gap < 3 s
    spec.write_text(json.dumps({'rank': 1, 'delay': 1.2}))
    ch = RayChannel(16, 2)
    try:
        _put_step(ch, 1, cfg)
        t0 = time.monotonic()
        upd = g.update(ch, 1, timeout=30)
        took = time.monotonic() - t0
    finally:
        spec.write_text(json.dumps({'rank': -1}))
        ch.close()
    # longer than the stall timeout, and not stopped
    assert took > cfg.health.stall_timeout_s + 1, took
    assert [u['optimizer_steps'] for u in upd] == [2, 2] and [u['micro_batches'] for u in upd] == [
        4,
        4,
    ]
    assert sum(u['rows_consumed'] for u in upd) == 8


def test_stalled_rank_is_named(ray_session):
    from memagent.colocate import make_group
    from memagent.backends.ray import StallError
    from memagent.transfer import RayChannel

    _, spec = ray_session
    cfg = _cfg(3.0)
    g = make_group(cfg, 0, world_size=2)
    # rank 1 never finishes its second micro-batch
    spec.write_text(json.dumps({'rank': 1, 'stall_at': 2}))
    ch = RayChannel(16, 2)
    try:
        _put_step(ch, 1, cfg)
        t0 = time.monotonic()
        with pytest.raises(StallError) as e:
            g.update(ch, 1, timeout=30)
        took = time.monotonic() - t0
    finally:
        spec.write_text(json.dumps({'rank': -1}))
        ch.close()
        g.close()
    msg = str(e.value)
    assert (
        msg.startswith("step 1: rank 1 made no progress for ") and 'health.stall_timeout_s=3' in msg
    ), msg
    assert 'its last progress: finished micro-batch 1/2 of mini-batch 1/2' in msg, msg
    # what the rank did before it stalled (a scoring pass, a micro-batch) takes well under 10 s here
    assert took < cfg.health.stall_timeout_s + 10, took
    with pytest.raises(RuntimeError, match='the policy group was stopped: step 1: rank 1'):
        g.hf_state_dict()
