"""Fault injection for the row channels: every failure mode ends within a wall-clock bound
(pytest-timeout turns a
hang into a failure) with an error that names the step and the numbers. Every test runs against both
`InProcessChannel` and `RayChannel`; Ray starts once for the module."""

import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memagent.trajectory import Row
from memagent.transfer import (
    ChannelError,
    InProcessChannel,
    RayChannel,
    ensure_ray,
    rows_to_arrays,
    arrays_to_rows,
)
from memagent.bench import bench_channel

pytestmark = pytest.mark.timeout(60)


def make_rows(n, step=0):
    return [
        Row(
            f's{step}t{i // 4}',
            i // 8,
            i % 4,
            4,
            1.0,
            0.5,
            0.125,
            1 / n,
            [1, 2, 3, i],
            [5] * (1 + i % 3),
            [-0.25] * (1 + i % 3),
            [1] * (1 + i % 3),
        )
        for i in range(n)
    ]


@pytest.fixture(scope='module')
def ray_session():
    ray = ensure_ray()
    # consumer tasks below are defined in this file, which Ray workers cannot import: ship them by
    # value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.shutdown()


@pytest.fixture(params=['inprocess', 'ray'])
def make_channel(request):
    made = []

    def make(capacity=64, world_size=None):
        if request.param == 'inprocess':
            ch = InProcessChannel(capacity, world_size)
        else:
            request.getfixturevalue('ray_session')
            ch = RayChannel(capacity, world_size)
        made.append(ch)
        return ch

    make.kind = request.param
    yield make
    for ch in made:
        if hasattr(ch, 'close'):
            ch.close()


def test_put_get_exact_slices(make_channel):
    ch = make_channel()
    rows = make_rows(8)
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(ch.get, 7, r, 2, 10.0) for r in range(2)]
        assert ch.put(7, rows) == 8
        got = [f.result(timeout=15) for f in futs]
    assert got == [rows[:4], rows[4:]]
    assert ch.counts(7) == {'produced': 8, 'consumed': 8}
    with pytest.raises(ChannelError, match='was released'):
        ch.get(7, 0, 2, 1.0)


def test_producer_raises_mid_step(make_channel):
    ch = make_channel()

    def producer():
        try:
            rows = []
            for i in range(10):
                if i == 5:
                    raise RuntimeError('engine died at row 5')
                rows += make_rows(1)
            ch.put(3, rows)
        except Exception as e:
            ch.fail(3, e)

    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(ch.get, 3, r, 2, 20.0) for r in range(2)]
        time.sleep(0.3)  # consumers are waiting before the failure
        ex.submit(producer).result(timeout=10)
        for f in futs:
            with pytest.raises(
                ChannelError, match='rollout 3 failed: RuntimeError: engine died at row 5'
            ):
                f.result(timeout=10)
    assert time.monotonic() - t0 < 15, 'fail() must wake waiters long before their 20 s timeout'


def test_producer_never_reports(make_channel):
    ch = make_channel()
    t0 = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"rollout 'never': rank 1 of 2 got no rows within 0.5 s"
    ):
        ch.get('never', 1, 2, timeout=0.5)
    assert 0.5 <= time.monotonic() - t0 < 10


def test_consumer_asks_for_future_step(make_channel):
    ch = make_channel()
    ch.put(0, make_rows(4))
    with pytest.raises(
        TimeoutError, match=r'rollout 1: rank 0 of 2 .* not produced yet \(latest produced: 0\)'
    ):
        ch.get(1, 0, 2, timeout=0.3)
    assert len(ch.get(0, 0, 2, 1.0)) == 2  # the produced step is untouched


def test_count_zero(make_channel):
    ch = make_channel()
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(ch.get, 5, 0, 2, 20.0)
        time.sleep(0.2)
        with pytest.raises(ValueError, match='rollout 5: put 0 rows'):
            ch.put(5, [])
        with pytest.raises(ChannelError, match='put 0 rows'):
            fut.result(timeout=10)
    assert ch.counts(5) == {'produced': 0, 'consumed': 0}


def test_count_not_divisible(make_channel):
    ch = make_channel()
    ch.put(2, make_rows(5))
    with pytest.raises(ValueError, match='rollout 2: 5 rows do not divide by world_size 2'):
        ch.get(2, 0, 2, 1.0)
    ch2 = make_channel(world_size=2)
    with pytest.raises(ValueError, match='rollout 2: 5 rows do not divide by world_size 2'):
        ch2.put(2, make_rows(5))
    with pytest.raises(ChannelError, match='do not divide'):
        ch2.get(2, 1, 2, 1.0)


def test_over_capacity(make_channel):
    ch = make_channel(capacity=6)
    with pytest.raises(ValueError, match='rollout 4: put 8 rows > capacity 6'):
        ch.put(4, make_rows(8))
    with pytest.raises(ChannelError, match='capacity 6'):
        ch.get(4, 0, 2, 1.0)


def _consume(ch, rank, world, steps, timeout=20.0):
    "One consumer rank: take its rows of each step; return what it saw."
    return {s: [(r.traj_id, r.turn_index) for r in ch.get(s, rank, world, timeout)] for s in steps}


def test_two_steps_two_ranks(make_channel):
    world, sizes = 2, {0: 12, 1: 18}
    ch = make_channel(capacity=32, world_size=world)
    if make_channel.kind == 'ray':
        ray = ensure_ray()
        task = ray.remote(num_cpus=0)(_consume)
        refs = [task.remote(ch, r, world, list(sizes)) for r in range(world)]
        wait = lambda: ray.get(refs, timeout=30)
    else:
        ex = ThreadPoolExecutor(world)
        futs = [ex.submit(_consume, ch, r, world, list(sizes)) for r in range(world)]
        wait = lambda: [f.result(timeout=30) for f in futs]
    generated, transferred = {}, {}
    for s, n in sizes.items():
        rows = make_rows(n, step=s)
        generated[s] = [(r.traj_id, r.turn_index) for r in rows]
        transferred[s] = ch.put(s, rows)
        time.sleep(0.1)
    seen = wait()
    report = {}
    for s in sizes:
        consumed = [x for rank in seen for x in rank[s]]
        report[s] = dict(
            generated=len(generated[s]), transferred=transferred[s], consumed=len(consumed)
        )
        assert consumed == generated[s]  # all rows, none of another step, in order
        assert [len(rank[s]) for rank in seen] == [sizes[s] // world] * world
        assert ch.counts(s) == {'produced': sizes[s], 'consumed': sizes[s]}
        assert (
            report[s]['generated'] == report[s]['transferred'] == report[s]['consumed'] == sizes[s]
        )
    print(make_channel.kind, report)


def test_ray_batched_parts_and_arrays(ray_session):
    ch = RayChannel(64)
    rows = make_rows(10)
    assert ch.put('p', rows, batch_size=3) == 10  # 4 parts, sealed with the count
    assert ch.get('p', 0, 1, 5.0) == rows
    assert arrays_to_rows(rows_to_arrays(rows)) == rows
    r1 = bench_channel(64, batched=True, prompt_tokens=200, response_tokens=50)
    r2 = bench_channel(64, batched=False, prompt_tokens=200, response_tokens=50)
    assert r1['n_rows'] == r2['n_rows'] == 64
    print(
        'batched',
        round(r1['rows_per_s']),
        'rows/s; per-row puts',
        round(r2['rows_per_s']),
        'rows/s',
    )
    ch.close()
