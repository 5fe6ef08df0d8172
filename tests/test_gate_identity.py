"""The acceptance gate checks who and what was evaluated, not only the numbers: every role's records
name the same
items on the same data (recomputed from the records and the data file, never read from the summary),
the roles are
three different runs of three different models, and every field the report shows is recomputed or
marked
unverified. Each failure is a failed check in the report, not a crash. The runs are real evaluations
of tiny
random models (`memagent.evaluate.evaluate` with an HF engine)."""

import json, shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from memagent.acceptance import compare, render_acceptance
from memagent.evaluate import RECORDS_FILE, SUMMARY_FILE, evaluate, summarize, write_run

IDENTITY = ('items', 'data', 'distinct_runs', 'distinct_models')


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    """Three checkpoints (the tiny base and two perturbed copies), two data files, and each model
    evaluated on the first."""
    import torch
    from memagent.checkpoint import export_hf
    from memagent.config import get_preset
    from memagent.data import make_synthetic, write_examples
    from memagent.engines import HFEngine
    from memagent.models import load_model, load_tokenizer, model_dir

    tmp = tmp_path_factory.mktemp('gate')
    cfg = get_preset(
        'tiny',
        {
            'chunking.chunk_tokens': 32,
            'chunking.memory_tokens': 4,
            'chunking.final_tokens': 4,
            'chunking.max_chunks': 2,
            'eval.top_p': 1.0,
        },
    )
    tok, m = load_tokenizer('tiny-qwen3'), load_model('tiny-qwen3')
    models = {'base': str(model_dir('tiny-qwen3'))}
    # other weights, other answers: three different runs
    for i, role in enumerate(('reference', 'candidate'), 1):
        g = torch.Generator().manual_seed(i)
        sd = {
            k: v + torch.randn(v.shape, generator=g).to(v.dtype) for k, v in m.state_dict().items()
        }
        models[role] = str(export_hf(m, tok, tmp / role, state_dict=sd))
    data = tmp / 'data'
    files = {
        'a': write_examples(make_synthetic(3, num_words=40, seed=1), data / 'a.jsonl'),
        'b': write_examples(make_synthetic(3, num_words=40, seed=2), data / 'b.jsonl'),
    }

    def run(role, data_file, out):
        eng = HFEngine(load_model(models[role]), tok)
        evaluate(
            data_file,
            eng,
            tok,
            cfg,
            out_dir=out,
            model_name=models[role],
            samples=1,
            batch_size=3,
            progress=False,
            n_boot=50,
        )
        return out

    runs = {role: run(role, files['a'], tmp / 'runs' / role) for role in models}
    runs['candidate_on_b'] = run('candidate', files['b'], tmp / 'runs' / 'candidate_on_b')
    return {'tmp': tmp, 'files': files, 'runs': runs, 'models': models}


def gate(cand, ref, base):
    return compare(cand, ref, base, require_hotpotqa=False, n_boot=50)


def failed(rep, name, key=None):
    return [
        c['reason']
        for c in rep['checks']
        if c['name'] == name and not c['passed'] and (key is None or c['key'] == key)
    ]


def copy_run(src, dst) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_summary(run_dir, fn):
    p = Path(run_dir) / SUMMARY_FILE
    s = json.loads(p.read_text())
    fn(s)
    p.write_text(json.dumps(s))


def synthetic_trio(root, solved=(520, 500, 400)):
    """Hand-made runs (`memagent.testing.synthetic_run`) of three models that pass the gate: 52.0 vs
    50.0 vs 40.0 sub_EM."""
    from memagent.provenance import sha256_text
    from memagent.testing import synthetic_run

    return {
        role: Path(
            synthetic_run(
                root / role, n, info={'model': {'name': role, 'weights_sha256': sha256_text(role)}}
            )
        ).parent
        for role, n in zip(('candidate', 'reference', 'base'), solved)
    }


def renamed(run_dir, dst, rename=lambda i: 'other-' + i) -> Path:
    """A copy of a run whose records name other item ids (`rename`), its summary rebuilt from them
    (every number checks out)."""
    dst = copy_run(run_dir, dst)
    recs = [json.loads(l) for l in (dst / RECORDS_FILE).read_text().splitlines()]
    for r in recs:
        r['id'] = rename(r['id'])
    old = json.loads((dst / SUMMARY_FILE).read_text())
    s = summarize(
        recs,
        {
            k: v
            for k, v in old.items()
            if k not in ('metrics', 'pass_at_k', 'pass_at_n', 'records', 'parity_extras')
        },
        n_boot=old['bootstrap']['resamples'],
        seed=old['bootstrap']['seed'],
    )
    write_run(dst, recs, s)
    return dst


def test_honest_runs_pass_every_identity_check(world):
    r = world['runs']
    rep = gate(r['candidate'], r['reference'], r['base'])
    ident = [c for c in rep['checks'] if c['name'] in IDENTITY]
    assert {c['name'] for c in ident} == set(IDENTITY) and all(c['passed'] for c in ident), [
        c['reason'] for c in ident
    ]
    data = next(c for c in ident if c['name'] == 'data')
    assert (
        data['verified'] == ['base', 'candidate', 'reference']
        and 'recomputed from' in data['reason']
    )


def test_candidate_on_other_data_with_copied_hashes_fails(world):
    """The candidate read file b; its summary is given file a's path and hashes: the records betray
    it."""
    r, t = world['runs'], world['tmp']
    ref = json.loads((r['reference'] / SUMMARY_FILE).read_text())
    forged = copy_run(r['candidate_on_b'], t / 'forged')
    edit_summary(forged, lambda s: s.update(data=ref['data']))
    rep = gate(forged, r['reference'], r['base'])
    assert rep['passed'] is False
    why = failed(rep, 'records')
    assert why and f"the records are not the items of data file {world['files']['a']}" in why[0], (
        rep['reasons']
    )
    # the data file gone: its hash cannot be recomputed, but the records' item ids still disagree
    # with the reference's
    moved = t / 'data_moved'
    shutil.copytree(world['files']['a'].parent, moved)
    shutil.rmtree(world['files']['a'].parent)
    try:
        rep = gate(forged, r['reference'], r['base'])
        assert rep['passed'] is False and not failed(rep, 'records')
        assert any('3 items not in the reference' in x for x in failed(rep, 'items')), rep[
            'reasons'
        ]
        data = next(c for c in rep['checks'] if c['name'] == 'data')
        assert data['verified'] == [] and 'recorded, unverified' in data['reason']
    finally:
        shutil.copytree(moved, world['files']['a'].parent)


def test_synthetic_candidate_on_other_items_fails_a_gate_it_would_pass(tmp_path):
    """Runs that pass the gate; the candidate's records are of other items, its summary's data
    fields the reference's."""
    r = synthetic_trio(tmp_path)
    assert compare(r['candidate'], r['reference'], r['base'], require_hotpotqa=False)['passed']
    forged = renamed(r['candidate'], tmp_path / 'forged')
    ref = json.loads((r['reference'] / SUMMARY_FILE).read_text())
    edit_summary(forged, lambda s: s.update(data=ref['data']))
    rep = compare(forged, r['reference'], r['base'], require_hotpotqa=False)
    assert rep['passed'] is False and rep['paired']['200']['candidate_vs_reference'] == {'items': 0}
    assert [x.split(':')[0] for x in rep['reasons']] == ['items[200]'], rep['reasons']
    assert (
        "1000 items not in the reference's records" in rep['reasons'][0]
        and "'other-q00000'" in rep['reasons'][0]
    )


def test_the_reference_given_as_candidate_fails(world, tmp_path):
    # passes with its own candidate; the reference as candidate does not
    r = synthetic_trio(tmp_path)
    assert compare(r['candidate'], r['reference'], r['base'], require_hotpotqa=False)['passed']
    rep = compare(r['reference'], r['reference'], r['base'], require_hotpotqa=False)
    assert rep['passed'] is False and [x.split(':')[0] for x in rep['reasons']] == [
        'distinct_runs[200]',
        'distinct_models[200]',
    ]
    r, t = world['runs'], world['tmp']
    for cand in (r['reference'], copy_run(r['reference'], t / 'ref_copy')):
        rep = gate(cand, r['reference'], r['base'])
        assert rep['passed'] is False
        assert any('candidate and reference are' in x for x in failed(rep, 'distinct_runs')), rep[
            'reasons'
        ]
        assert any(
            'candidate and reference are one model (weights_sha256' in x
            for x in failed(rep, 'distinct_models')
        ), rep['reasons']


def test_mismatched_record_item_ids_fail(world):
    """A candidate whose records name another item id (summary rebuilt to match, so the numbers
    check out)."""
    r, t = world['runs'], world['tmp']
    first = json.loads((r['candidate'] / RECORDS_FILE).read_text().splitlines()[0])['id']
    bad = renamed(
        r['candidate'], t / 'renamed', lambda i: 'an-item-never-asked' if i == first else i
    )
    rep = gate(bad, r['reference'], r['base'])
    assert rep['passed'] is False and any(
        "'an-item-never-asked'" in x and 'not the items of data file' in x
        for x in failed(rep, 'records')
    ), rep['reasons']
    # no data file to check against: the roles disagree
    edit_summary(bad, lambda s: s['data'].update(path=None))
    rep = gate(bad, r['reference'], r['base'])
    why = failed(rep, 'items')
    assert (
        rep['passed'] is False
        and why
        and "'an-item-never-asked'" in why[0]
        and "'synthetic-h1-s1-0'" in why[0]
    ), rep['reasons']


def test_a_tampered_display_field_is_caught_or_shown_unverified(world):
    r, t = world['runs'], world['tmp']
    cand = copy_run(r['candidate'], t / 'display')
    edit_summary(cand, lambda s: s.update(chunks_mean=s['chunks_mean'] + 1))
    rep = gate(cand, r['reference'], r['base'])
    assert any('chunks_mean' in x for x in failed(rep, 'records')), rep['reasons']

    def faster(s):
        s['chunks_mean'] -= 1
        s['timing']['wall_s'] = 0.001

    edit_summary(cand, faster)  # chunks_mean restored; wall_s cannot be recomputed
    rep = gate(cand, r['reference'], r['base'])
    assert not failed(rep, 'records')
    sums = {
        role: {rep['lengths'][0]: json.loads((d / SUMMARY_FILE).read_text())}
        for role, d in (('candidate', cand), ('reference', r['reference']), ('base', r['base']))
    }
    text = render_acceptance(t / 'display_report', rep, sums).read_text()
    verified = text.split('## What the gate verified')[1].split('\n## ')[0]
    assert '**Unverified**' in verified and '`timing.wall_s`' in verified
    assert '## Models' in text and 'name (recorded)' in text and 'mode (recorded)' in text


@pytest.mark.timeout(300)
def test_the_acceptance_notebook_renders_a_failed_identity_check(tmp_path):
    """Three copies of one model: the notebook still writes its report, which says NOT PASSED and
    why."""
    pm = pytest.importorskip('papermill')
    from test_acceptance_nb import TINY

    pm.execute_notebook(
        str(ROOT / 'nbs' / 'acceptance.ipynb'),
        str(tmp_path / 'executed.ipynb'),
        parameters={
            **TINY,
            'out_root': str(tmp_path / 'reports'),
            'eval_data': 'sample-haystack-1',
            'lengths': [10],
            'hotpotqa': False,
        },
        cwd=str(ROOT),
        progress_bar=False,
        kernel_name='python3',
    )
    rep = tmp_path / 'reports' / 'tiny'
    report = json.loads((rep / 'compare.json').read_text())
    readme = (rep / 'README.md').read_text()
    assert report['passed'] is False and '**NOT PASSED**' in readme
    for r in (
        'distinct_models[10]: candidate and reference are one model',
        'distinct_runs[10]: candidate and reference are',
    ):
        assert any(x.startswith(r) for x in report['reasons']) and r in readme, (
            r,
            report['reasons'],
        )
    assert all(c['passed'] for c in report['checks'] if c['name'] in ('items', 'data'))
    assert '## What the gate verified' in readme


def _two_sample_run(out, right, info):
    """A hand-made run of 4 items x 2 samples: sample s of item i is right when s < right[i]
    (records scored, summary rebuilt)."""
    from memagent.evaluate import score_record
    from memagent.testing import synthetic_run

    base = json.loads(Path(synthetic_run(out, 4, n_items=4, samples=2, info=info)).read_text())
    recs = [
        score_record(
            {
                'id': f'q{i:05d}',
                'sample': s,
                'answers': ['yes'],
                'response': '\\boxed{yes}' if s < right[i] else '\\boxed{no}',
                'num_chunks': 1,
                'truncated': False,
                'dropped_tokens': 0,
                'memory_lengths': [1],
                'error': None,
            },
            'relax',
        )
        for i in range(4)
        for s in range(2)
    ]
    return _rewrite(out, recs, base)


def _rewrite(out, recs, old):
    "Write `recs` with a summary rebuilt from them: every number the gate recomputes checks out."
    keep = {
        k: v
        for k, v in old.items()
        if k not in ('metrics', 'pass_at_k', 'pass_at_n', 'records', 'parity_extras')
    }
    write_run(
        out,
        recs,
        summarize(recs, keep, n_boot=old['bootstrap']['resamples'], seed=old['bootstrap']['seed']),
    )
    return Path(out)


def test_wrong_samples_replaced_by_copies_of_right_ones_fail(tmp_path):
    """The candidate got one of two samples right on every item (50%); its wrong samples are
    replaced by copies of its right ones."""
    from memagent.provenance import sha256_text

    info = lambda r: {'model': {'name': r, 'weights_sha256': sha256_text(r)}}
    ref = _two_sample_run(tmp_path / 'reference', [2, 2, 2, 2], info('reference'))
    base = _two_sample_run(tmp_path / 'base', [0, 0, 0, 1], info('base'))
    cand = _two_sample_run(tmp_path / 'candidate', [1, 1, 1, 1], info('candidate'))
    honest = compare(cand, ref, base, require_hotpotqa=False, n_boot=50)
    assert honest['values']['200']['candidate']['value'] == 50.0 and failed(honest, 'tolerance')
    recs = [json.loads(l) for l in (cand / RECORDS_FILE).read_text().splitlines()]
    forged = [
        r if r['sample'] == 0 else next(x for x in recs if x['id'] == r['id'] and x['sample'] == 0)
        for r in recs
    ]
    _rewrite(cand, forged, json.loads((cand / SUMMARY_FILE).read_text()))
    rep = compare(cand, ref, base, require_hotpotqa=False, n_boot=50)
    assert rep['passed'] is False
    why = failed(rep, 'records')
    assert why and "4 duplicate (id, sample) records, e.g. [('q00000', 0)" in why[0], rep['reasons']


def test_records_that_claim_fewer_chunks_than_their_documents_fail(world):
    """The candidate's records claim 1 chunk per sample, its summary rebuilt to match and its data
    fields the reference's."""
    r, t = world['runs'], world['tmp']
    honest = gate(r['candidate'], r['reference'], r['base'])
    chunks = [c for c in honest['checks'] if c['name'] == 'chunks']
    assert len(chunks) == 3 and all(c['passed'] and c['verified'] for c in chunks), [
        c['reason'] for c in chunks
    ]
    cand = copy_run(r['candidate'], t / 'one_chunk')
    recs = [json.loads(l) for l in (cand / RECORDS_FILE).read_text().splitlines()]
    assert {x['num_chunks'] for x in recs} == {2}
    for x in recs:
        x.update(num_chunks=1, truncated=False, dropped_tokens=0)
    old = json.loads((cand / SUMMARY_FILE).read_text())
    old['data'] = json.loads((r['reference'] / SUMMARY_FILE).read_text())['data']
    _rewrite(cand, recs, old)
    rep = gate(cand, r['reference'], r['base'])
    # every number checks out against the records
    assert not failed(rep, 'records') and not failed(rep, 'items')
    why = failed(rep, 'chunks')
    assert (
        why
        and why[0].startswith('candidate: 3 records disagree with their documents')
        and 'num_chunks 1 recorded, 2 recomputed' in why[0]
    )
    # the tokenizer the summary names, with a file changed: the counts cannot be recomputed, which
    # fails too
    tdir = t / 'tok_copy'
    shutil.copytree(old['tokenizer']['path'], tdir)
    (tdir / 'tokenizer_config.json').write_text((tdir / 'tokenizer_config.json').read_text() + ' ')
    edit_summary(cand, lambda s: s['tokenizer'].update(path=str(tdir)))
    why = failed(gate(cand, r['reference'], r['base']), 'chunks')
    assert (
        why and 'differ from the recorded hashes' in why[0] and 'tokenizer_config.json' in why[0]
    ), why


def test_a_truncated_sample_fails_the_gate(world):
    r, t = world['runs'], world['tmp']
    assert not failed(gate(r['candidate'], r['reference'], r['base']), 'not_truncated')
    cand = copy_run(r['candidate'], t / 'cut')
    recs = [json.loads(l) for l in (cand / RECORDS_FILE).read_text().splitlines()]
    recs[0]['truncated'] = True
    _rewrite(cand, recs, json.loads((cand / SUMMARY_FILE).read_text()))
    rep = gate(cand, r['reference'], r['base'])
    assert any('1 of 3 samples cut at max_chunks=2' in x for x in failed(rep, 'not_truncated')), (
        rep['reasons']
    )
    assert any(
        'truncated False recomputed' in x or "truncated True recorded" in x
        for x in failed(rep, 'chunks')
    ), rep['reasons']


def test_the_task_reward_reads_negatives_from_the_data_file(world, tmp_path):
    """answer_without_distractors: scored from each response with the data file's answers and
    negatives; no data file, no score."""
    from memagent.data import read_examples
    from memagent.reward import answer_without_distractors

    r = world['runs']
    rep = compare(
        r['candidate'],
        r['reference'],
        r['base'],
        require_hotpotqa=False,
        n_boot=50,
        metric='answer_without_distractors',
    )
    exs = {e['id']: e for e in read_examples(world['files']['a'])}
    for role in ('candidate', 'reference', 'base'):
        recs = [json.loads(l) for l in (r[role] / RECORDS_FILE).read_text().splitlines()]
        want = (
            100
            * sum(
                answer_without_distractors(
                    x['response'],
                    exs[x['id']]['answers'],
                    exs[x['id']]['meta'].get('negatives', []),
                )
                for x in recs
            )
            / len(recs)
        )
        assert rep['values'][str(rep['lengths'][0])][role]['value'] == pytest.approx(want)
    assert 'from ' + str(world['files']['a']) in rep['values'][str(rep['lengths'][0])]['source']
    eq = rep['equivalence'][str(rep['lengths'][0])]
    assert eq['verdict'] in ('equivalent', 'different', 'undecided') and eq['items'] == 3
    gone = {role: copy_run(r[role], tmp_path / role) for role in ('candidate', 'reference', 'base')}
    for d in gone.values():
        edit_summary(d, lambda s: s['data'].update(path=None))
    rep = compare(
        gone['candidate'],
        gone['reference'],
        gone['base'],
        require_hotpotqa=False,
        n_boot=50,
        metric='answer_without_distractors',
    )
    assert any(
        "needs each item's answers and negatives from the data file" in x
        for x in failed(rep, 'metric')
    ), rep['reasons']


def test_memagent_compare_takes_the_metric(world, tmp_path, capsys):
    from memagent.acceptance import compare_cli

    r = world['runs']
    args = [
        '--candidate',
        str(r['candidate']),
        '--reference',
        str(r['reference']),
        '--base',
        str(r['base']),
        '--no-hotpotqa',
    ]
    rc = compare_cli(
        args + ['--out', str(tmp_path / 'a.json'), '--metric', 'answer_without_distractors']
    )
    rep = json.loads((tmp_path / 'a.json').read_text())
    assert rc in (0, 1) and rep['metric'] == 'answer_without_distractors'
    assert rep['values'][str(rep['lengths'][0])]['metric'] == 'answer_without_distractors'
    assert (
        compare_cli(args + ['--out', str(tmp_path / 'b.json'), '--metric', 'no_such_metric']) == 1
    )
    assert any(
        "'no_such_metric' is neither a metric" in x
        for x in json.loads((tmp_path / 'b.json').read_text())['reasons']
    )
