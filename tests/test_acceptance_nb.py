"""The acceptance notebook end to end through papermill, with tiny random models, on a tiny file set
in the pinned
format (the recipe's file names, prepared by `memagent.data.prepare`): it cannot pass, and the
report must say so
with reasons, disclose truncation, and prove each role's model. The shipped-sample haystacks stay
available under
their honest name, and a report built on them says it is not the recipe's evaluation set."""

import json, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TINY = dict(
    base_model='tiny-qwen3',
    reference_model='tiny-qwen3',
    candidate_model='tiny-qwen3',
    preset='tiny',
    overrides={
        'chunking.chunk_tokens': 64,
        'chunking.memory_tokens': 4,
        'chunking.final_tokens': 4,
        'chunking.max_chunks': 1,
        'eval.top_p': 1.0,
    },
    max_items=None,
    hotpotqa=True,
    samples=1,
    batch_size=2,
    run_name='tiny',
    progress=False,
)


def pinned_format_root(tmp_path, n_questions: int = 2) -> Path:
    """A data root prepared from tiny files with the pinned names and formats: eval_50.json
    (RULER-HQA rows) and hotpotqa_dev.parquet (verl rows)."""
    import pyarrow as pa, pyarrow.parquet as pq
    from memagent.data import build_haystack, doc_pool, from_hotpotqa, load_hotpotqa, prepare

    src = tmp_path / 'pinned_src'
    src.mkdir()
    every = load_hotpotqa()
    rows, pool = every[:n_questions], doc_pool(every)
    for n in (50,):
        exs = build_haystack(rows, pool, n, seed=0, progress=False)
        (src / f'eval_{n}.json').write_text(
            json.dumps(
                [
                    {
                        '_id': e['id'],
                        'input': e['question'],
                        'context': e['context'],
                        'answers': e['answers'],
                        'num_docs': e['num_docs'],
                    }
                    for e in exs
                ]
            )
        )
    hq = [from_hotpotqa(r) for r in rows]
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    'data_source': 'hotpotqa',
                    'prompt': [{'role': 'user', 'content': e['question']}],
                    'context': e['context'],
                    'ability': 'memory',
                    'reward_model': {'style': 'rule', 'ground_truth': e['answers']},
                    'extra_info': {
                        'index': i,
                        'question': e['question'],
                        'num_docs': e['num_docs'],
                    },
                }
                for i, e in enumerate(hq)
            ]
        ),
        src / 'hotpotqa_dev.parquet',
    )
    root = tmp_path / 'data_root'
    prepare(root, source=src, unverified=True, files=["eval_50.json", "hotpotqa_dev.parquet"])
    return root


def _run(tmp_path, cwd=None, **params):
    """The notebook through papermill, its report in tmp_path/reports: by absolute path from the
    repository root, or (cwd) as a relative out_root."""
    pm = pytest.importorskip('papermill')
    pm.execute_notebook(
        str(ROOT / 'nbs' / 'acceptance.ipynb'),
        str(tmp_path / 'executed.ipynb'),
        parameters={**TINY, 'out_root': 'reports' if cwd else str(tmp_path / 'reports'), **params},
        cwd=str(cwd or ROOT),
        progress_bar=False,
        kernel_name='python3',
    )
    return tmp_path / 'reports' / 'tiny'


@pytest.mark.timeout(300)
def test_acceptance_notebook_tiny_pinned_format(tmp_path):
    rep = _run(
        tmp_path, eval_data='pinned', data_root=str(pinned_format_root(tmp_path)), lengths=[50]
    )
    readme = (rep / 'README.md').read_text()
    for f in (
        'compare.json',
        'sub_em.png',
        'summaries/candidate_50.json',
        'summaries/base_hotpotqa.json',
        'runs/reference/50/records.jsonl',
    ):
        assert (rep / f).is_file(), f
    head = readme.split('## Verdict')[0]
    assert (
        "NOT the recipe" not in head
        and "pinned evaluation files" in head
        and '**UNVERIFIED**' in head
    )
    report = json.loads((rep / 'compare.json').read_text())
    assert report['passed'] is False and report['reasons']
    # three copies of one random model tie: none beats the base
    assert any(r.startswith('beats_base[50]') for r in report['reasons'])
    assert '**NOT PASSED**' in readme and 'beats_base[50]' in readme
    # 50 documents are far more than 1 chunk of 64 tokens: the report must disclose it
    assert (
        '## Truncation disclosure' in readme
        and '**Truncation occurred.**' in readme
        and 'did NOT read the whole' in readme
    )
    s = json.loads((rep / 'summaries' / 'candidate_50.json').read_text())
    assert (
        s['truncated_samples'] == 2
        and s['dropped_tokens'] > 0
        and s['complete']
        and s['errors'] == 0
    )
    assert s['data']['name'] == 'eval_50.jsonl' and s['parity'] == 'relax'
    assert (
        s['data']['prepared']['pinned'] == 'eval_50.json'
        and s['data']['prepared']['verified'] is False
    )
    assert s['served_model']['how'] == 'model object loaded from the checkpoint directory'
    assert report["lengths"] == [50] and {c['name'] for c in report['checks']} >= {
        'comparable',
        'complete',
        'no_errors',
        'tolerance',
        'beats_base',
        'records',
    }
    assert all(c['passed'] for c in report['checks'] if c['name'] in ('records', 'comparable'))
    # the pinned files record no gold positions: the memory analysis counts every record as skipped,
    # and says why
    ret = json.loads((rep / 'retention_50.json').read_text())
    assert {m: r['skipped'] for m, r in ret['models'].items()} == {
        r: {'no gold position': 2} for r in ('base', 'reference', 'candidate')
    }
    assert '## What the memory holds: 50 documents' in readme and "'no gold position': 2" in readme


@pytest.mark.timeout(300)
def test_acceptance_notebook_memory_analysis_on_own_haystacks(tmp_path):
    """The project's haystacks record their gold documents: retention is anchored at the chunk where
    the last one begins."""
    from memagent.chunking import chunk_document
    from memagent.data import read_examples
    from memagent.models import load_tokenizer
    from memagent.memreport import gold_chunks

    ov = {**TINY['overrides'], 'chunking.chunk_tokens': 256, 'chunking.max_chunks': 12}
    rep = _run(tmp_path, eval_data='sample-haystack-2', lengths=[10], overrides=ov)
    ret = json.loads((rep / 'retention_10.json').read_text())
    tok = load_tokenizer('tiny-qwen3')
    exs = read_examples(rep / 'data' / 'sample_haystack_10.jsonl')
    anchors = sorted(
        max(gold_chunks(e, chunk_document(e['context'], tok, 256, 12).texts)) for e in exs
    )
    for r in ret['models'].values():
        assert r['skipped'] == {} and sorted(x['anchor'] for x in r['records']) == anchors
        assert r['by_offset']['0'][1] == 2 and all(
            len(x['held']) == x['turns'] - x['anchor'] for x in r['records']
        )
    readme = (rep / 'README.md').read_text()
    assert '## What the memory holds: 10 documents' in readme and '(gold) |' in readme
    assert (rep / 'trajectories_10.md').read_text().count('| answer |') == 2 and (
        rep / 'retention_10.png'
    ).is_file()


def test_sample_haystacks_say_they_are_not_the_recipe_set(tmp_path, capsys):
    """A model that does not exist is refused by the checks, before the sets are built (nothing
    written); with the models
        there, the data cell (run in process after the checks, as papermill runs it) builds the sets
        and
        names them honestly."""
    pm = pytest.importorskip('papermill')
    with pytest.raises(pm.PapermillExecutionError, match='no-such-model'):
        _run(
            tmp_path,
            eval_data='sample-haystack-1',
            lengths=[10],
            base_model=str(tmp_path / 'no-such-model'),
        )
    assert not (tmp_path / 'reports' / 'tiny').exists()
    cells = [
        ''.join(c['source'])
        for c in json.loads((ROOT / 'nbs' / 'acceptance.ipynb').read_text())['cells']
        if c['cell_type'] == 'code'
    ]
    ns = {}
    exec(cells[0], ns)
    ns.update(TINY, eval_data='sample-haystack-1', lengths=[10], out_root=str(tmp_path / 'reports'))
    for src in cells[1:]:
        exec(src, ns)
        if 'examples_of = ' in src:
            break
    assert (tmp_path / 'reports' / 'tiny' / 'data' / 'sample_haystack_10.jsonl').is_file() and len(
        ns['examples_of'][10]
    ) == 1
    shown = capsys.readouterr().out
    assert "**Not the recipe's evaluation set.**" in shown and 'first 1 questions' in shown


def test_missing_pinned_files_name_the_prepare_command(tmp_path):
    pm = pytest.importorskip('papermill')
    with pytest.raises(pm.PapermillExecutionError, match='memagent-prepare --root'):
        _run(tmp_path, eval_data='pinned', data_root=str(tmp_path / 'empty'), lengths=[50])


def test_roles_cannot_share_a_server(tmp_path):
    pm = pytest.importorskip('papermill')
    with pytest.raises(pm.PapermillExecutionError, match='one model per engine'):
        _run(
            tmp_path,
            eval_data='sample-haystack-1',
            lengths=[10],
            hotpotqa=False,
            overrides={**TINY['overrides'], 'rollout.engine': 'sglang'},
            urls={
                'base': 'http://127.0.0.1:9',
                'reference': 'http://127.0.0.1:9',
                'candidate': 'http://127.0.0.1:8',
            },
        )


def test_a_role_served_by_the_wrong_model_is_refused_before_scoring(tmp_path):
    """One URL per role; the base's server serves another checkpoint: the run stops, naming both,
    and nothing is generated."""
    pm = pytest.importorskip('papermill')
    from memagent.checkpoint import export_hf
    from memagent.models import load_model, model_dir
    from memagent.testing import FakeSGLangServer

    m = load_model('tiny-qwen3')
    other = export_hf(
        m,
        None,
        tmp_path / 'other',
        state_dict={k: v + 1 for k, v in m.state_dict().items()},
        identity=False,
    )
    with (
        FakeSGLangServer(model_path=str(other)) as wrong,
        FakeSGLangServer(model_path=str(model_dir('tiny-qwen3'))) as ok,
    ):
        with pytest.raises(pm.PapermillExecutionError) as e:
            _run(
                tmp_path,
                eval_data='sample-haystack-1',
                lengths=[10],
                hotpotqa=False,
                overrides={**TINY['overrides'], 'rollout.engine': 'sglang'},
                urls={
                    'base': wrong.url,
                    'reference': ok.url,
                    'candidate': ok.url.replace('127.0.0.1', 'localhost'),
                },
            )
        assert 'ModelMismatchError' in str(e.value) and f'model_path {other}' in str(e.value)
        assert f"path {model_dir('tiny-qwen3').resolve()}" in str(e.value)
        assert wrong.calls == [] and ok.calls == []


def _two_tiny_policies(tmp_path):
    """Two different tiny models (the tiny base's weights, perturbed by two seeds), exported as HF
    directories."""
    import torch
    from memagent.checkpoint import export_hf
    from memagent.models import load_model, load_tokenizer

    m, tok = load_model('tiny-qwen3'), load_tokenizer('tiny-qwen3')
    out = {}
    for i, role in enumerate(('reference', 'candidate'), 1):
        g = torch.Generator().manual_seed(i)
        out[role] = str(
            export_hf(
                m,
                tok,
                tmp_path / role,
                state_dict={
                    k: v + 0.02 * torch.randn(v.shape, generator=g).to(v.dtype)
                    for k, v in m.state_dict().items()
                },
            )
        )
    return out


@pytest.mark.timeout(400)
def test_acceptance_notebook_keycode_lengths(tmp_path, monkeypatch):
    """The embedded task's path at tiny size: two lengths in chunks, a few items, two different tiny
    models against the base."""
    from memagent.chunking import chunk_document
    from memagent.data import read_examples
    from memagent.models import load_tokenizer

    pol = _two_tiny_policies(tmp_path)
    # out_root relative, as the README runs it
    rep = _run(
        tmp_path,
        cwd=tmp_path,
        eval_data='keycode',
        lengths=[2, 3],
        max_items=6,
        hotpotqa=None,
        overrides={'eval.top_p': 1.0},
        reference_model=pol['reference'],
        candidate_model=pol['candidate'],
    )
    report = json.loads((rep / 'compare.json').read_text())
    readme = (rep / 'README.md').read_text()
    assert (
        report['metric'] == 'boxed_em'
        and report['lengths'] == [2, 3]
        and 'hotpotqa' not in report['values']
    )
    for L in ('2', '3'):
        assert (
            report['equivalence'][L]['verdict'] in ('equivalent', 'different', 'undecided')
            and report['equivalence'][L]['items'] == 6
        )
        assert report['equivalence'][L]['text'] in readme
        assert {
            c['role']
            for c in report['checks']
            if c['name'] == 'chunks' and c['key'] == int(L) and c['passed'] and c['verified']
        } == {'base', 'reference', 'candidate'}
        assert all(
            c['passed']
            for c in report['checks']
            if c['name'] in ('not_truncated', 'distinct_models', 'distinct_runs', 'data', 'items')
        )
    tok = load_tokenizer('tiny-qwen3')
    # the tiny preset trains 3 facts in 3 chunks: density 1 per chunk
    for L, facts in (
        (2, 2),
        (3, 3),
    ):
        exs = read_examples(rep / 'data' / f'keycode_{L}.jsonl')
        assert len(exs) == 6 and all(len(e['meta']['fact_chunks']) == facts for e in exs)
        assert all(chunk_document(e['context'], tok, 32).token_counts == [32] * L for e in exs)
    assert (
        "not the recipe's evaluation set" in readme.split('## Verdict')[0]
        and '## Time and load per phase' in readme
    )
    assert (rep / 'boxed_em.png').is_file() and '## What the memory holds: 3 chunks' in readme
    s = json.loads((rep / 'summaries' / 'candidate_3.json').read_text())
    assert s['limits']['max_chunks'] == 3 and s['truncated_samples'] == 0
    # the rendered folder verifies as a whole from its own files (from the folder the run was made
    # in, as its data paths are relative to it), and an edited README does not
    monkeypatch.chdir(tmp_path)
    from memagent.acceptance import compare_cli
    from memagent.acceptance.report import verify_acceptance

    assert verify_acceptance(rep)['verdicts'] == {
        L: report['equivalence'][L]['text'] for L in ('2', '3')
    }
    assert compare_cli(['--verify', str(rep)]) == 0
    (rep / 'README.md').write_text(readme.replace('## Verdict', '## Verdict\n\nAll good.', 1))
    assert compare_cli(['--verify', str(rep)]) == 1


@pytest.mark.parametrize(
    'params, match',
    [
        ({'lengths': [3, 0]}, 'parameter lengths'),
        ({'lengths': [2.0, 3]}, 'parameter lengths'),
        ({'tolerance_pp': float('nan')}, 'parameter tolerance_pp'),
        ({'tolerance_pp': float('inf')}, 'parameter tolerance_pp'),
        ({'samples': 1.5}, 'parameter samples'),
        ({'progress': 'false'}, "-y 'progress: false'"),
        ({'hotpotqa': 'no'}, 'parameter hotpotqa'),
        ({'max_items': 'probe', 'eval_data': 'sample-haystack-1'}, "max_items='probe'"),
        ({'lengths': [3, 4096]}, 'parameter lengths'),
        ({'hotpotqa': True}, 'no HotpotQA set'),
        ({'metric': 'no_such_metric'}, 'parameter metric'),
    ],
)
def test_acceptance_bad_parameters_are_refused_before_anything_is_written(tmp_path, params, match):
    from memagent.testing import run_notebook_cells

    p = {
        **TINY,
        'eval_data': 'keycode',
        'lengths': [2, 3],
        'max_items': 6,
        'hotpotqa': None,
        'out_root': str(tmp_path / 'reports'),
        'progress': False,
        **params,
    }
    ns, err = run_notebook_cells(ROOT / 'nbs' / 'acceptance.ipynb', p, cells=1)
    assert isinstance(err, ValueError) and match in str(err), err
    assert not (tmp_path / 'reports').exists()
