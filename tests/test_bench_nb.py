"""The benchmark notebook end to end through papermill with the tiniest parameters: the report must hold every section,
its figures and the machine-readable results."""
import json, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path: sys.path.insert(0, str(ROOT))

TINY = dict(run='tiny', n_traj=4, channel_rows=8, channel_prompt_tokens=16, channel_response_tokens=8,
            doc_counts=[10, 12], eval_items=1, trainer_rows=2, trainer_repeats=1, gen_model='tiny-qwen3', gen_requests=[2, 3],
            gen_prompt_tokens=12, gen_new_tokens=3, gen_repeats=1, matmul_n=64, bandwidth_mb=4, phase_traj=2)
SECTIONS = ('## Summary', '## (a) Rollout', '## (b) Rollout log-probs', "## (c) The trainer's micro-batches", '## (d) Row channel',
            '## (e) Linear cost', '## (f) Trainer log-probs', "## (g) The engine vs transformers' generate()",
            "## (h) How close to the machine's limits", '## (i) Rollout phases', '## Parameters', '## Provenance', '## Files')


@pytest.mark.timeout(180)
def test_bench_notebook_tiny(tmp_path):
    pm = pytest.importorskip('papermill')
    out = tmp_path / 'executed.ipynb'
    pm.execute_notebook(str(ROOT / 'nbs' / 'bench.ipynb'), str(out), parameters={**TINY, 'out_root': str(tmp_path / 'bench')},
                        cwd=str(ROOT), progress_bar=False, kernel_name='python3')
    rep = tmp_path / 'bench' / 'tiny'
    readme = (rep / 'README.md').read_text()
    for s in SECTIONS: assert s in readme, s
    for f in ('rollout.png', 'packing.png', 'channel.png', 'linear_cost.png', 'trainer.png', 'generate.png', 'limits.png',
              'rollout_phases.png', 'bench.json'):
        assert (rep / f).is_file() and f'({f})' in readme, f
    assert 'load_average_start' in readme and 'load_average_end' in readme
    res = json.loads((rep / 'bench.json').read_text())
    measures = [r['measure'] for r in res['summary']]
    for tag in ('(a)', '(b)', '(c)', '(d)', '(e)', '(f)', '(g)', '(h)', '(i)'): assert any(m.startswith(tag) for m in measures), tag
    # (g): one ratio per request count, both sides generating exactly gen_new_tokens per request
    assert [g['requests'] for g in res['generate']] == TINY['gen_requests']
    for g in res['generate']:
        assert g['engine']['tokens'] == g['generate']['tokens'] == g['requests'] * TINY['gen_new_tokens']
        assert g['engine']['prefill_calls'] == g['generate']['prefill_calls'] == 1
    assert sum(m.startswith('(g)') for m in measures) == len(TINY['gen_requests'])
    # (h): both limits measured and every decode row carries its fraction of the bandwidth bound
    lim = res['limits']
    assert lim['matmul_gflops'] > 0 and lim['bandwidth']['read_gbs'] > 0 and lim['weight_bytes'] > 0
    assert [r['batch'] for r in lim['decode']] == [1] + TINY['gen_requests'] and all(r['of bandwidth bound'] > 0 for r in lim['decode'])
    # (i): the phases of both rollouts add up to their wall times
    rp = res['rollout_phases']
    for k in ('batched_phases', 'sequential_phases'):
        p = rp[k]; assert abs(p['prefill_s'] + p['decode_s'] + p['other_s'] - p['wall_s']) < 1e-6 and p['prefill_calls'] >= 1
    assert rp['n_traj'] == TINY['phase_traj'] and rp['phases']['decode_speedup'] > 0
    # ratios and goals are reported, never asserted on timings; the log-prob agreement is numerical, not timed
    assert res['logprobs'][0]['max_abs_diff'] < 1e-4 and res['rollout']['identical_fraction'] == 1.0
    assert {r['met'] for r in res['summary']} <= {'yes', 'NO', '-'}
