"""Evaluation and comparison: the acceptance rule's edges on synthetic runs, refusals that name the
field, reproducible
intervals, the base prompt keeping the question, and a real tiny evaluation writing every field."""

import json, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memagent.evaluate import (
    COMPARABLE,
    METRICS,
    RECORD_FIELDS,
    RECORDS_FILE,
    SCHEMA_VERSION,
    SUMMARY_FILE,
    evaluate,
    item_limit,
    summarize,
)
from memagent.stats import bootstrap_ci, paired_bootstrap_ci
from memagent.acceptance import compare, compare_cli
from memagent.provenance import sha256_text
from memagent.testing import synthetic_run, synthetic_trio as trio


def run(r, **kw):
    return compare(r['candidate'], r['reference'], r['base'], **kw)


def test_tolerance_edges(tmp_path):
    ok = run(trio(tmp_path / 'a', 529, 500, 400))  # 52.9 vs 50.0: 2.9 pp
    assert ok['passed'], ok['reasons']
    tol = next(c for c in ok['checks'] if c['name'] == 'tolerance')
    assert tol['gap_pp'] == pytest.approx(2.9)
    bad = run(trio(tmp_path / 'b', 531, 500, 400))  # 3.1 pp
    assert not bad['passed'] and bad['reasons'] == [
        'tolerance[200]: |sub_em candidate - reference| = |53.10 - 50.00| = 3.10 pp > 3.0 pp'
    ]
    below = run(trio(tmp_path / 'c', 471, 500, 400))  # 2.9 pp below the reference also passes
    assert below['passed']
    assert run(trio(tmp_path / 'd', 520, 500, 400), tolerance_pp=1.0)['passed'] is False


def test_ties_with_base_fail(tmp_path):
    r = run(trio(tmp_path / 'a', 500, 500, 500))
    assert not r['passed'] and any(
        x.startswith('beats_base[200]') and 'must be strictly better' in x for x in r['reasons']
    )
    # equal counts write identical records: one run twice
    r = run(trio(tmp_path / 'b', 510, 500, 400, hot=(40, 50, 40)))
    assert [x.split(':')[0] for x in r['reasons']] == [
        'distinct_runs[hotpotqa]',
        'beats_base[hotpotqa]',
    ]
    assert (
        r['reasons'][1]
        == 'beats_base[hotpotqa]: boxed_em candidate 40.00 <= base 40.00 (must be strictly better)'
    )


def test_missing_hotpotqa_fails_unless_waived(tmp_path):
    r = trio(tmp_path, 510, 500, 400)
    only = {k: {200: v[200]} for k, v in r.items()}
    rep = run(only)
    assert not rep['passed'] and any(
        'has no run for' in x and 'hotpotqa' in x for x in rep['reasons']
    )
    assert run(only, require_hotpotqa=False)['passed']


@pytest.mark.parametrize(
    'field,value',
    [
        ('prompts.template_sha256.memory', 'x' * 64),
        ('data.sha256', 'e' * 64),
        ('sampling.temperature', 1.0),
        ('sampling.top_p', 1.0),
        ('limits.max_chunks', 32),
        ('tokenizer.vocab_sha256', 'w' * 64),
        ('thinking', 'on'),
    ],
)
def test_mismatch_names_the_field(tmp_path, field, value):
    rep = run(trio(tmp_path, 510, 500, 400, cinfo={field: value}))
    assert not rep['passed']
    comp = [x for x in rep['reasons'] if x.startswith('comparable[200]')]
    assert comp and field in comp[0], rep['reasons']
    failed = next(c for c in rep['checks'] if c['name'] == 'comparable' and not c['passed'])
    assert field in failed['fields']


def test_moved_run_is_the_same_run_but_edited_records_are_refused(tmp_path):
    r = trio(tmp_path / 'a', 510, 500, 400)
    moved = tmp_path / 'elsewhere'
    (tmp_path / 'a' / 'candidate').rename(moved)
    cand = {200: moved / '200', 'hotpotqa': moved / 'hotpotqa'}
    assert compare(cand, r['reference'], r['base'])['passed']
    p = moved / '200' / RECORDS_FILE
    p.write_text(p.read_text().replace('"no"', '"yes"', 1))
    rep = compare(cand, r['reference'], r['base'])
    assert not rep['passed'] and any(
        x.startswith('records[200]') and 'SHA-256' in x for x in rep['reasons']
    )


def test_errored_or_incomplete_runs_cannot_pass(tmp_path):
    rep = run(trio(tmp_path / 'e', 600, 590, 400, errors=1))
    assert not rep['passed'] and any(
        x.startswith('no_errors[200]: candidate: 1 request errors') for x in rep['reasons']
    )
    rep = run(trio(tmp_path / 'i', 600, 590, 400, drop=1))
    assert not rep['passed'] and any(
        x.startswith('complete[200]: candidate: 999 of 1000') for x in rep['reasons']
    )
    s = json.loads((tmp_path / 'i' / 'candidate' / '200' / SUMMARY_FILE).read_text())
    assert (
        s['complete'] is False
        and s['totals']['items'] == 1000
        and s['totals']['items_recorded'] == 999
    )


def test_errors_stay_in_the_denominator():
    # an errored record scores 0 whatever it says
    recs = [
        dict(id='a', sample=0, **{m: 1.0 for m in METRICS}, error=None),
        dict(id='b', sample=0, **{m: 1.0 for m in METRICS}, error='timeout'),
    ]
    s = summarize(recs, {'totals': {'items': 2, 'samples_per_item': 1}})
    assert s['metrics']['sub_em']['value'] == 50.0 and s['errors'] == 1 and s['successful'] == 1


def test_bootstrap_reproducible():
    v = [0, 1, 1, 0, 1, 1, 1, 0, 0, 1] * 5
    assert bootstrap_ci(v, seed=3) == bootstrap_ci(v, seed=3) != bootstrap_ci(v, seed=4)
    a, b = [1, 0, 1, 1] * 10, [1, 0, 0, 1] * 10
    assert paired_bootstrap_ci(a, b, seed=1) == paired_bootstrap_ci(a, b, seed=1)
    lo, hi = paired_bootstrap_ci(a, b, seed=1)
    assert 0 < lo <= 0.25 <= hi


def test_item_limit_is_explicit():
    from memagent.config import get_preset

    cfg = get_preset('tiny', {'eval.max_items': 5})
    assert (
        item_limit('config', cfg),
        item_limit(None, cfg),
        item_limit(0, cfg),
        item_limit(7, cfg),
    ) == (5, None, 0, 7)
    for bad in (-1, 'all', 2.0, True):
        with pytest.raises(ValueError, match='max_items'):
            item_limit(bad, cfg)


def test_zero_items_is_refused_not_all(tiny):
    cfg, tok, eng = tiny
    from memagent.data import make_synthetic

    with pytest.raises(ValueError, match=r'no examples to evaluate \(max_items=0\)'):
        evaluate(
            make_synthetic(2, num_words=20, seed=0), eng, tok, cfg, max_items=0, progress=False
        )


def test_compare_cli_exit_codes(tmp_path):
    trio(tmp_path, 510, 500, 400)
    args = ['--reference', str(tmp_path / 'reference'), '--base', str(tmp_path / 'base')]
    assert (
        compare_cli(
            ['--candidate', str(tmp_path / 'candidate'), *args, '--out', str(tmp_path / 'ok.json')]
        )
        == 0
    )
    assert (
        compare_cli(
            [
                '--candidate',
                str(tmp_path / 'candidate'),
                *args,
                '--out',
                str(tmp_path / 'no.json'),
                '--tolerance-pp',
                '0.5',
            ]
        )
        == 1
    )
    assert json.loads((tmp_path / 'no.json').read_text())['passed'] is False
    assert (
        compare_cli(
            ['--candidate', str(tmp_path / 'nowhere'), *args, '--out', str(tmp_path / 'x.json')]
        )
        == 2
    )


@pytest.fixture(scope='module')
def tiny():
    from memagent.config import get_preset
    from memagent.engines import HFEngine
    from memagent.models import load_model, load_tokenizer

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
    tok = load_tokenizer('tiny-qwen3')
    return cfg, tok, HFEngine(load_model('tiny-qwen3'), tok)


def test_base_mode_keeps_the_question(tiny, tmp_path):
    cfg, tok, eng = tiny
    q = 'Which city is the capital of the fictional land of Zembla?'
    ex = [
        {
            'id': 'huge',
            'question': q,
            'context': 'filler words go here. ' * 4000,
            'answers': ['Onhava'],
            'num_docs': 1,
            'source': 'test',
            'meta': {},
        }
    ]
    seen = []

    class Spy:
        def __init__(self, e):
            self.e = e

        def generate(self, prompts, params, return_exceptions=False):
            seen.extend(prompts)
            return self.e.generate(prompts, params, return_exceptions=return_exceptions)

    s = evaluate(
        ex,
        Spy(eng),
        tok,
        cfg,
        mode='base',
        out_dir=tmp_path,
        samples=1,
        base_max_tokens=96,
        progress=False,
    )
    text = tok.decode(seen[0])
    assert q in text and len(seen[0]) < 96 + 40  # the question survives, the context was cut
    rec = json.loads((tmp_path / RECORDS_FILE).read_text().splitlines()[0])
    assert (
        rec['truncated']
        and rec['dropped_tokens'] > 15000
        and s['dropped_tokens'] == rec['dropped_tokens']
    )
    assert s['mode'] == 'base' and s['limits']['base_max_tokens'] == 96


def test_real_tiny_evaluation_writes_every_field(tiny, tmp_path):
    cfg, tok, eng = tiny
    from memagent.data import make_synthetic, write_examples

    data = write_examples(make_synthetic(3, num_words=80, seed=1), tmp_path / 'd.jsonl')
    s = evaluate(
        data,
        eng,
        tok,
        cfg,
        out_dir=tmp_path / 'run',
        model_name='tiny-qwen3',
        samples=2,
        batch_size=2,
        progress=False,
    )
    recs = [json.loads(l) for l in (tmp_path / 'run' / RECORDS_FILE).read_text().splitlines()]
    assert len(recs) == 6 and all(set(r) == set(RECORD_FIELDS) for r in recs)
    assert sorted((r['id'], r['sample']) for r in recs) == sorted(
        (r['id'], s_) for r in recs[::2] for s_ in (0, 1)
    )
    disk = json.loads((tmp_path / 'run' / SUMMARY_FILE).read_text())
    for k in (
        'schema_version',
        'mode',
        'data',
        'prompts',
        'thinking',
        'tokenizer',
        'model',
        'sampling',
        'seeds',
        'limits',
        'totals',
        'successful',
        'errors',
        'truncated_samples',
        'dropped_tokens',
        'metrics',
        'pass_at_k',
        'pass_at_n',
        'bootstrap',
        'provenance',
        'records',
    ):
        assert k in disk, k
    assert disk['schema_version'] == SCHEMA_VERSION and disk['prompts']['variant'] == 'eval'
    from memagent.provenance import sha256_file

    assert disk['data']['sha256'] == sha256_file(data) and disk['model']['weights_sha256']
    assert (
        disk['tokenizer']['vocab_sha256']
        and disk['sampling']['temperature'] == cfg.eval.temperature
    )
    assert disk['limits']['max_chunks'] == 2 and disk['seeds']['eval'] == cfg.eval.seed
    assert disk['totals'] == {**disk['totals'], 'items': 3, 'samples_per_item': 2, 'samples': 6}
    assert set(disk['metrics']) == set(METRICS) and all(
        len(m['ci95']) == 2 for m in disk['metrics'].values()
    )
    assert disk['errors'] == 0 and disk['complete'] and disk['truncated_samples'] > 0
    # the same seed reproduces the run; a run compares with itself
    s2 = evaluate(
        data,
        eng,
        tok,
        cfg,
        out_dir=tmp_path / 'run2',
        model_name='tiny-qwen3',
        samples=2,
        batch_size=3,
        progress=False,
    )
    recs2 = [json.loads(l) for l in (tmp_path / 'run2' / RECORDS_FILE).read_text().splitlines()]
    # batching does not change results
    assert [r['response'] for r in recs] == [r['response'] for r in recs2]
    rep = compare(tmp_path / 'run', tmp_path / 'run2', tmp_path / 'run', require_hotpotqa=False)
    assert all(
        c['passed']
        for c in rep['checks']
        if c['name'] in ('comparable', 'complete', 'no_errors', 'tolerance')
    )


# request errors: a network blip is retried, a failed request is recorded, and the exit code says so


def _sglang_client(srv, **kw):
    from memagent.engines import SGLangEngine

    return SGLangEngine(
        [srv.url], **{'timeout_s': 5, 'max_retries': 2, 'backoff_s': 0.01, 'concurrency': 2, **kw}
    )


@pytest.mark.timeout(120)
def test_cut_connection_does_not_abort_an_evaluation(tiny, tmp_path):
    cfg, tok, _ = tiny
    from memagent.data import make_synthetic
    from memagent.testing import FakeSGLangServer

    exs = make_synthetic(3, num_words=40, seed=0)
    with FakeSGLangServer() as srv:
        cl = _sglang_client(srv)
        srv.faults = ['cut', 'drop']  # retried: the run is clean
        s = evaluate(
            exs,
            cl,
            tok,
            cfg,
            out_dir=tmp_path / 'a',
            samples=1,
            batch_size=3,
            progress=False,
            n_boot=10,
        )
        assert s['errors'] == 0 and s['complete'] and cl.stats['retries'] == 2
        cl = _sglang_client(srv, max_retries=0, concurrency=1)
        srv.faults = ['cut']  # no retry left: that sample errors, the others are kept
        s = evaluate(
            exs,
            cl,
            tok,
            cfg,
            out_dir=tmp_path / 'b',
            samples=1,
            batch_size=3,
            progress=False,
            n_boot=10,
        )
        recs = [json.loads(l) for l in (tmp_path / 'b' / RECORDS_FILE).read_text().splitlines()]
        assert len(recs) == 3 and s['errors'] == 1 and s['complete']
        assert sum('ChunkedEncodingError' in (r['error'] or '') for r in recs) == 1
        cl.close()


@pytest.mark.timeout(180)
def test_evaluate_cli_fails_on_request_errors(tmp_path):
    from memagent.data import make_synthetic, write_examples
    from memagent.evaluate import evaluate_cli
    from memagent.testing import FakeSGLangServer

    data = write_examples(make_synthetic(2, num_words=30, seed=0), tmp_path / 'd.jsonl')
    from memagent.models import model_dir

    with FakeSGLangServer(model_path=str(model_dir('tiny-qwen3'))) as srv:
        args = [
            '--model',
            'tiny-qwen3',
            '--data',
            str(data),
            '--mode',
            'base',
            '--base-max-tokens',
            '64',
            '--no-progress',
            '--set',
            'chunking.final_tokens=4',
            '--set',
            'rollout.engine=sglang',
            '--set',
            f'rollout.sglang_urls=[{srv.url}]',
            '--set',
            'rollout.max_retries=0',
            '--all-items',
        ]
        srv.faults = [500]
        # one of two requests failed
        assert evaluate_cli([*args, '--out', str(tmp_path / 'one')]) == 1
        assert json.loads((tmp_path / 'one' / SUMMARY_FILE).read_text())['errors'] == 1
        srv.faults = [500]
        assert evaluate_cli([*args, '--out', str(tmp_path / 'allowed'), '--allow-errors']) == 0
        srv.faults = [500, 500]
        # every request failed
        assert evaluate_cli([*args, '--out', str(tmp_path / 'all'), '--allow-errors']) == 1
        s = json.loads((tmp_path / 'all' / SUMMARY_FILE).read_text())
        assert s['errors'] == s['totals']['samples'] == 2
        assert evaluate_cli([*args, '--out', str(tmp_path / 'clean')]) == 0


def test_compare_cli_refuses_missing_dirs_and_negative_tolerance(tmp_path):
    trio(tmp_path, 510, 500, 400)
    args = ['--reference', str(tmp_path / 'reference'), '--base', str(tmp_path / 'base')]
    cand = [
        '--candidate',
        f"200={tmp_path / 'candidate' / '200'}",
        f"hotpotqa={tmp_path / 'candidate' / 'hotpotqa'}",
    ]
    assert compare_cli([*cand, *args, '--out', str(tmp_path / 'ok.json')]) == 0
    missing = [
        '--candidate',
        f"200={tmp_path / 'nowhere'}",
        f"hotpotqa={tmp_path / 'candidate' / 'hotpotqa'}",
    ]
    assert compare_cli([*missing, *args, '--out', str(tmp_path / 'm.json')]) == 2
    assert not (tmp_path / 'm.json').exists()
    # refused while the arguments are parsed (memagent.config.cli_number): argparse exits 2
    for tol in (
        '-0.5',
        'nan',
        'inf',
    ):
        with pytest.raises(SystemExit) as e:
            compare_cli([*cand, *args, '--out', str(tmp_path / 't.json'), '--tolerance-pp', tol])
        assert e.value.code == 2
    assert not (tmp_path / 't.json').exists()
    with pytest.raises(ValueError, match='tolerance_pp'):
        compare(
            tmp_path / 'candidate' / '200',
            tmp_path / 'reference' / '200',
            tmp_path / 'base' / '200',
            tolerance_pp=-1,
        )


# the gate recomputes what it judges


def test_tampered_summary_is_refused_and_not_passed_stays_not_passed(tmp_path):
    r = trio(tmp_path, 531, 500, 400)  # 3.1 pp from the reference: NOT PASSED
    assert run(r)['passed'] is False
    sp = tmp_path / 'candidate' / '200' / SUMMARY_FILE
    s = json.loads(sp.read_text())
    s['metrics']['sub_em']['value'] = 52.0  # raised so the gap would look like 2 pp
    sp.write_text(json.dumps(s))
    rep = run(r)
    assert rep['passed'] is False
    why = [x for x in rep['reasons'] if x.startswith('records[200]')]
    assert (
        why
        and str(sp.parent) in why[0]
        and 'metrics.sub_em.value = 52.0 in the summary but' in why[0]
    ), rep['reasons']
    assert not any(x.startswith('tolerance[200]') and 'pp <=' in x for x in rep['reasons'])
    out = tmp_path / 'cli.json'
    assert (
        compare_cli(
            [
                '--candidate',
                str(tmp_path / 'candidate'),
                '--reference',
                str(tmp_path / 'reference'),
                '--base',
                str(tmp_path / 'base'),
                '--out',
                str(out),
            ]
        )
        == 1
    )


@pytest.mark.parametrize(
    'field,value',
    [
        ('errors', 0),
        ('complete', True),
        ('metrics.boxed_em.ci95', [0.0, 100.0]),
        ('pass_at_n.sub_em', 99.0),
        ('parity', 'official'),
    ],
)
def test_any_judged_number_that_disagrees_refuses(tmp_path, field, value):
    # the summary says 0 errors where there is 1
    r = trio(tmp_path, 510, 500, 400, errors=1 if field == 'errors' else 0)
    sp = tmp_path / 'candidate' / '200' / SUMMARY_FILE
    s = json.loads(sp.read_text())
    d = s
    *head, last = field.split('.')
    for k in head:
        d = d[k]
    assert d[last] != value or isinstance(value, bool)
    d[last] = (not d[last]) if isinstance(value, bool) else value
    sp.write_text(json.dumps(s))
    rep = run(r)
    assert not rep['passed'] and any(
        x.startswith('records[200]') and field in x for x in rep['reasons']
    ), rep['reasons']


def test_a_record_whose_score_does_not_follow_from_its_response_is_refused(tmp_path):
    from memagent.evaluate import write_run

    r = trio(tmp_path, 510, 500, 400)
    d = tmp_path / 'candidate' / '200'
    recs = [json.loads(l) for l in (d / RECORDS_FILE).read_text().splitlines()]
    recs[600]['sub_em'] = 1.0  # an unsolved item marked solved, summary rebuilt to match
    s = summarize(
        recs,
        {
            k: v
            for k, v in json.loads((d / SUMMARY_FILE).read_text()).items()
            if k not in ('metrics', 'pass_at_k', 'pass_at_n', 'records')
        },
        n_boot=200,
        seed=0,
    )
    write_run(d, recs, s)
    rep = run(r)
    assert not rep['passed'] and any(
        'records[q00600/0].sub_em = 1.0 but 0.0 recomputed' in x for x in rep['reasons']
    ), rep['reasons']


def test_mixed_parity_is_not_comparable(tmp_path):
    r = trio(tmp_path, 510, 500, 400)
    synthetic_run(tmp_path / 'candidate' / '200', 510, parity='official')
    rep = run(r)
    assert not rep['passed']
    assert any(
        x.startswith('comparable[200]') and "parity differs ('official' vs 'relax')" in x
        for x in rep['reasons']
    ), rep['reasons']
    s = json.loads((tmp_path / 'candidate' / '200' / SUMMARY_FILE).read_text())
    assert s['parity'] == 'official' and 'official_drop_empty' in s['parity_extras']


def test_records_and_summary_carry_the_parity_mode(tiny, tmp_path):
    cfg, tok, eng = tiny
    from memagent.config import apply_overrides
    from memagent.data import make_synthetic

    for mode in ('relax', 'official'):
        s = evaluate(
            make_synthetic(2, num_words=30, seed=0),
            eng,
            tok,
            apply_overrides(cfg, {'eval.parity': mode}),
            out_dir=tmp_path / mode,
            samples=1,
            progress=False,
            n_boot=10,
        )
        recs = [json.loads(l) for l in (tmp_path / mode / RECORDS_FILE).read_text().splitlines()]
        assert s['parity'] == mode and {r['parity'] for r in recs} == {mode}
        from memagent.acceptance import load_run

        assert load_run(tmp_path / mode)['recomputed']['metrics'] == s['metrics']


@pytest.mark.timeout(120)
def test_evaluate_cli_refuses_an_engine_it_cannot_use_before_any_request(tmp_path, capsys):
    """The served-model check's failures, and server URLs that are not URLs, are refusals (exit 2,
    the reason on stderr, no
        output folder), not tracebacks: a closed port, a socket that never answers, HTML with status
        200, truncated JSON, an ftp
        URL and one that does not parse."""
    import http.server, socket, threading
    from memagent.data import make_synthetic, write_examples
    from memagent.evaluate import evaluate_cli

    data = write_examples(make_synthetic(2, num_words=30, seed=0), tmp_path / 'd.jsonl')

    class Reply(http.server.BaseHTTPRequestHandler):
        body = b'<html>a proxy page</html>'

        def do_GET(self):
            self.send_response(200)
            self.send_header('Content-Type', 'text/html')
            self.end_headers()
            self.wfile.write(self.body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(('127.0.0.1', 0), Reply)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    s = socket.socket()
    s.bind(('127.0.0.1', 0))
    closed = s.getsockname()[1]
    s.close()
    silent = socket.socket()
    silent.bind(('127.0.0.1', 0))
    silent.listen(4)  # accepts, never answers
    cases = [
        ('closed', f'http://127.0.0.1:{closed}', 'connection-level failure'),
        ('silent', f'http://127.0.0.1:{silent.getsockname()[1]}', 'timed out'),
        ('html', f'http://127.0.0.1:{srv.server_port}', 'no model_path in the reply'),
        ('truncated', f'http://127.0.0.1:{srv.server_port}', 'no model_path in the reply'),
        ('ftp', 'ftp://127.0.0.1:21', "is not an http(s) URL with a host"),
        ('unparsable', 'http://[::1', "the value is not YAML"),
    ]
    try:
        for name, url, why in cases:
            if name == 'truncated':
                Reply.body = b'{"model_path": "tiny-qwen3", "tok'
            out = tmp_path / name
            rc = evaluate_cli(
                [
                    '--model',
                    'tiny-qwen3',
                    '--data',
                    str(data),
                    '--mode',
                    'base',
                    '--no-progress',
                    '--out',
                    str(out),
                    '--set',
                    'rollout.engine=sglang',
                    '--set',
                    f'rollout.sglang_urls=[{url}]',
                    '--set',
                    'rollout.max_retries=0',
                ]
            )
            err = capsys.readouterr().err
            assert rc == 2 and err.startswith('memagent-evaluate: error: ') and why in err, (
                name,
                rc,
                err,
            )
            assert not out.exists(), name
    finally:
        srv.shutdown()
        silent.close()
