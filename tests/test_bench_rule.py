"""The rule that turns repeated timings into a goal's verdict: met only when every interleaved
repeat clears the goal,
not met only when every repeat misses it, undecided otherwise or when fewer than five repeats were
timed."""

import pytest

from memagent.bench import MIN_REPEATS, interleave, spread, verdict


def test_one_timing_decides_nothing():
    # the committed (a) figure, 5.50x, passed a 5x goal on its own; alone it must not decide
    assert verdict([5.50], '>=', 5) == 'undecided'
    assert verdict([9.0] * (MIN_REPEATS - 1), '>=', 5) == 'undecided'
    assert MIN_REPEATS == 5


def test_the_range_decides():
    # five runs of the same rollout ratio on one quiet host
    rollout = [
        3.64,
        5.50,
        3.27,
        6.34,
        6.65,
    ]
    assert verdict(rollout, '>=', 5) == 'undecided'
    assert verdict([5.1, 5.3, 5.0, 6.2, 5.8], '>=', 5) == 'met'
    assert verdict([5.1, 5.3, 5.0, 6.2, 5.8], '>', 5) == 'undecided'
    assert verdict([4.9, 3.2, 4.1, 4.99, 2.0], '>=', 5) == 'not met'
    # (h): prefill rates over each repeat's own matmul peak, 110 and 154 GFLOP/s among them
    prefill, peak = [86.7, 88.0, 87.1, 88.4, 86.9], [154.4, 110.0, 150.2, 112.5, 153.0]
    h = [p / m for p, m in zip(prefill, peak)]
    assert (
        verdict(h, '>=', 0.8) == 'undecided'
        and verdict(h, '>=', 0.5) == 'met'
        and verdict(h, '>=', 0.9) == 'not met'
    )
    assert verdict([2e-6] * 5, '<', 1e-4) == 'met' and verdict([2e-4] * 5, '<', 1e-4) == 'not met'
    assert verdict([9213], '<=', 9216, min_repeats=1) == 'met'  # an exact count


def test_spread_is_median_and_range():
    assert spread([3.64, 5.50, 3.27, 6.34, 6.65]) == dict(median=5.50, min=3.27, max=6.65, n=5)
    assert spread([1.0, 2.0, 3.0, 4.0]) == dict(median=2.5, min=1.0, max=4.0, n=4)


def test_interleave_alternates_sides():
    log = []
    r = interleave(
        {'A': lambda: log.append('A') or len(log), 'B': lambda: log.append('B') or len(log)}, 5
    )
    assert log == ['A', 'B'] * 5 and r == {'A': [1, 3, 5, 7, 9], 'B': [2, 4, 6, 8, 10]}


@pytest.mark.parametrize(
    'call,msg',
    [
        (lambda: verdict([1, 2, 3, 4, 5], '=>', 1), 'goal_op must be one of'),
        (lambda: verdict([], '>=', 1), 'no values'),
        (lambda: verdict([1, 2, float('nan'), 4, 5], '>=', 1), 'NaN'),
        (lambda: spread([]), 'no values'),
        (lambda: interleave({'A': lambda: 1}, 0), 'repeats must be an int >= 1'),
        (lambda: interleave({'A': lambda: 1}, True), 'repeats must be an int >= 1'),
    ],
)
def test_bad_input_is_refused(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()
