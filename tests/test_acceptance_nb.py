"""The acceptance notebook end to end through papermill, with tiny random models: it cannot pass, and the report
must say so with reasons and disclose truncation."""
import json, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path: sys.path.insert(0, str(ROOT))

TINY = dict(base_model='tiny-qwen3', reference_model='tiny-qwen3', candidate_model='tiny-qwen3', preset='tiny',
            overrides={'chunking.chunk_tokens': 64, 'chunking.memory_tokens': 4, 'chunking.final_tokens': 4,
                       'chunking.max_chunks': 1, 'eval.top_p': 1.0},
            lengths=[10, 12], n_items=2, hotpotqa=True, hotpotqa_items=2, samples=1, batch_size=2,
            run_name='tiny', progress=False)


@pytest.mark.timeout(240)
def test_acceptance_notebook_tiny(tmp_path):
    pm = pytest.importorskip('papermill')
    out = tmp_path / 'executed.ipynb'
    pm.execute_notebook(str(ROOT / 'nbs' / 'acceptance.ipynb'), str(out), parameters={**TINY, 'out_root': str(tmp_path / 'reports')},
                        cwd=str(ROOT), progress_bar=False, kernel_name='python3')
    rep = tmp_path / 'reports' / 'tiny'
    readme = (rep / 'README.md').read_text()
    for f in ('compare.json', 'sub_em.png', 'summaries/candidate_10.json', 'summaries/base_hotpotqa.json',
              'runs/reference/12/records.jsonl', 'data/ruler_hqa_12.jsonl'):
        assert (rep / f).is_file(), f
    report = json.loads((rep / 'compare.json').read_text())
    assert report['passed'] is False and report['reasons']
    # three copies of one random model tie: none beats the base
    assert any(r.startswith('beats_base[10]') for r in report['reasons'])
    assert '**NOT PASSED**' in readme and 'beats_base[10]' in readme
    # 10 HotpotQA paragraphs are far more than 1 chunk of 64 tokens: the report must disclose it
    assert '## Truncation disclosure' in readme and '**Truncation occurred.**' in readme and 'did NOT read the whole' in readme
    s = json.loads((rep / 'summaries' / 'candidate_12.json').read_text())
    assert s['truncated_samples'] == 2 and s['dropped_tokens'] > 0 and s['complete'] and s['errors'] == 0
    assert report['lengths'] == [10, 12] and {c['name'] for c in report['checks']} >= {'comparable', 'complete', 'no_errors',
                                                                                        'tolerance', 'beats_base'}
