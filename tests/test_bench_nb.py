"""The benchmark notebook end to end through papermill with the tiniest parameters: the report must
hold every section,
its figures and the machine-readable results, every timed figure from interleaved repeats with its
median, range and load;
a run that would decide goals from fewer than five repeats is refused."""

import json, statistics, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TINY = dict(
    run='tiny',
    repeats=2,
    quick=True,
    n_traj=4,
    channel_rows=8,
    channel_prompt_tokens=16,
    channel_response_tokens=8,
    doc_counts=[10, 12],
    eval_items=1,
    trainer_rows=2,
    gen_model='tiny-qwen3',
    gen_requests=[2, 3],
    gen_prompt_tokens=12,
    gen_new_tokens=3,
    matmul_n=64,
    bandwidth_mb=4,
)
SECTIONS = (
    '## Summary',
    '## (a) Rollout',
    '## (b) Rollout log-probs',
    "## (c) The trainer's micro-batches",
    '## (d) Row channel',
    '## (e) Linear cost',
    '## (f) Trainer log-probs',
    "## (g) The engine vs transformers' generate()",
    "## (h) How close to the machine's limits",
    '## (i) Rollout on',
    '## (j) Megatron training step',
    '## Parameters',
    '## Provenance',
    '## Files',
)
TIMED = ('(a)', '(d)', '(f)', '(g)', '(h)', '(i)', '(j)')


@pytest.mark.timeout(240)
def test_bench_notebook_tiny(tmp_path):
    pm = pytest.importorskip('papermill')
    out = tmp_path / 'executed.ipynb'
    pm.execute_notebook(
        str(ROOT / 'nbs' / 'bench.ipynb'),
        str(out),
        parameters={**TINY, 'out_root': str(tmp_path / 'bench')},
        cwd=str(ROOT),
        progress_bar=False,
        kernel_name='python3',
    )
    rep = tmp_path / 'bench' / 'tiny'
    readme = (rep / 'README.md').read_text()
    for s in SECTIONS:
        assert s in readme, s
    for f in (
        'rollout.png',
        'packing.png',
        'channel.png',
        'linear_cost.png',
        'trainer.png',
        'generate.png',
        'limits.png',
        'rollout_phases.png',
        'attention_step.png',
        'bench.json',
    ):
        assert (rep / f).is_file() and f'({f})' in readme, f
    assert 'load_average_start' in readme and 'load_average_end' in readme
    assert '| measure | median | range | repeats | goal | verdict | load 1m | note |' in readme
    res = json.loads((rep / 'bench.json').read_text())
    measures = [r['measure'] for r in res['summary']]
    for tag in ('(a)', '(b)', '(c)', '(d)', '(e)', '(f)', '(g)', '(h)', '(i)', '(j)'):
        assert any(m.startswith(tag) for m in measures), tag
    # every timed figure: one value and one load per repeat, median and range of those values; a
    # quick check decides nothing
    for r in res['summary']:
        assert r['verdict'] == ('-' if r['goal'] == 'reported' else 'undecided'), r
        if r['measure'].startswith(TIMED):
            assert r['repeats'] == TINY['repeats'] == len(r['values']) == len(r['loads']), r
            assert r['median'] == pytest.approx(statistics.median(r['values']))
            assert r['range'] == f"{min(r['values']):.4g}..{max(r['values']):.4g}"
        else:
            assert r['repeats'] == 'exact' or r['measure'].startswith('(e) linear fit'), r
    # (a), (i): each repeat is one batched and one sequential rollout of the same trajectories; (a)
    # on gen_model judges the decode phase, (i) on the tiny model decides nothing
    ra, ri = res['rollout'], res['rollout_tiny']
    assert (ra['model'], ri['model']) == (TINY['gen_model'], 'tiny-qwen3')
    assert (
        len(ra['repeats'])
        == len(ri['repeats'])
        == TINY['repeats']
        == ra['speedup']['n']
        == ri['speedup']['n']
    )
    assert ra['identical_fraction'] == ri['identical_fraction'] == 1.0
    assert ra['decode_speedup']['median'] == pytest.approx(
        statistics.median(r['phases']['decode_speedup'] for r in ra['repeats'])
    )
    a_goal = [
        r for r in res['summary'] if r['measure'].startswith('(a)') and r['goal'] != 'reported'
    ]
    assert (
        len(a_goal) == 1 and 'decode-phase' in a_goal[0]['measure'] and a_goal[0]['goal'] == '>= 5'
    )
    assert all(r['goal'] == 'reported' for r in res['summary'] if r['measure'].startswith('(i)'))
    # every timed row names the per-repeat values of both its sides, which the drift rule reads
    for r in res['summary']:
        if r['measure'].startswith(TIMED) and r['values']:
            assert len(r['sides']) == 2 and all(
                len(v) == TINY['repeats'] for v in r['sides'].values()
            ), r['measure']
    # (g): one ratio per request count and repeat, both sides generating exactly gen_new_tokens per
    # request
    assert [g['requests'] for g in res['generate']] == TINY['gen_requests']
    for g in res['generate']:
        assert len(g['repeats']) == len(g['ratios']) == TINY['repeats']
        for x in g['repeats']:
            assert (
                x['engine']['tokens']
                == x['generate']['tokens']
                == g['requests'] * TINY['gen_new_tokens']
            )
            assert x['engine']['prefill_calls'] == x['generate']['prefill_calls'] == 1
    assert sum(m.startswith('(g)') for m in measures) == len(TINY['gen_requests'])
    # (h): the matmul rate re-measured in every repeat, each repeat's prefill fraction over its own
    # rate
    lim = res['limits']
    assert len(lim['per_repeat']) == TINY['repeats'] and all(
        x['matmul GFLOP/s'] > 0 for x in lim['per_repeat']
    )
    h = next(r for r in res['summary'] if r['measure'].startswith('(h) prefill'))
    key = f"prefill GFLOP/s ({TINY['gen_requests'][-1]})"
    assert h['values'] == pytest.approx([x[key] / x['matmul GFLOP/s'] for x in lim['per_repeat']])
    assert lim['bandwidth']['read_gbs'] > 0 and lim['weight_bytes'] > 0
    assert [r['batch'] for r in lim['decode']] == [1] + TINY['gen_requests'] and all(
        r['of bandwidth bound'] > 0 for r in lim['decode']
    )
    # (i): the phases of both rollouts add up to their wall times in every repeat
    for r in res['rollout']['repeats']:
        for k in ('batched_phases', 'sequential_phases'):
            p = r[k]
            assert (
                abs(p['prefill_s'] + p['decode_s'] + p['other_s'] - p['wall_s']) < 1e-6
                and p['prefill_calls'] >= 1
            )
        assert r['n_traj'] == TINY['n_traj'] and r['phases']['decode_speedup'] > 0
    # the log-prob agreement is numerical, not timed
    assert res['logprobs'][0]['max_abs_diff'] < 1e-4
    # (j): both attention paths stepped in every repeat; the rows have different lengths, so SDPA
    # ran them packed
    js = res['attention_step']
    assert (
        len(js['local']) == len(js['sdpa']) == TINY['repeats']
        and js['packed_calls'] >= TINY['repeats'] + 1
    )


@pytest.mark.timeout(120)
def test_bench_refuses_too_few_repeats(tmp_path):
    pm = pytest.importorskip('papermill')
    with pytest.raises(pm.PapermillExecutionError, match='parameter repeats: at least 5'):
        pm.execute_notebook(
            str(ROOT / 'nbs' / 'bench.ipynb'),
            str(tmp_path / 'x.ipynb'),
            parameters={**TINY, 'quick': False, 'out_root': str(tmp_path / 'bench')},
            cwd=str(ROOT),
            progress_bar=False,
            kernel_name='python3',
        )
    assert not (tmp_path / 'bench').exists()
