"""Fast tests of memagent.data: converters, validation, readers, haystacks, synthetic task, command
line."""

import gzip, json, os, re, subprocess, sys
from pathlib import Path

import pytest

from memagent.data import (
    DataError,
    SHIPPED,
    build_haystack,
    convert,
    count_documents,
    doc_pool,
    from_hotpotqa,
    hotpotqa_path,
    load_hotpotqa,
    make_synthetic,
    paragraph_text,
    read_examples,
    shipped_data_dir,
    validate_example,
    verify_shipped,
    write_examples,
)

REPO = Path(__file__).resolve().parent.parent
ROW = {
    '_id': 'q1',
    'question': 'Who did it?',
    'answer': 'Ann',
    'type': 'bridge',
    'level': 'hard',
    'supporting_facts': [['B', 0], ['C', 1]],
    'context': [['A', ['One.', ' Two.']], ['B', ['Ann did it.']], ['C', ['Yes.', ' Really.']]],
}


def _write_jsonl(path, rows):
    path.write_text(''.join((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in rows))
    return path


def _bad_rows():
    "One good row, then one bad row of each kind, then a good one."
    no_q = {k: v for k, v in ROW.items() if k != 'question'}
    return [
        ROW,
        '{"_id": "x", "question": ',
        no_q,
        {**ROW, '_id': 'q2', 'context': []},
        {**ROW, '_id': 'q3', 'answer': 7},
        ROW,
        {**ROW, '_id': 'q4'},
    ]


def test_shipped_data():
    verify_shipped()
    assert set(p.name for p in (shipped_data_dir() / 'hotpotqa').glob('*.gz')) == {
        Path(p).name for p in SHIPPED
    }
    assert not list(shipped_data_dir().rglob('*fullwiki*'))
    with gzip.open(hotpotqa_path('train'), 'rt') as f:
        assert sum(1 for _ in f) == 210


def test_shipped_data_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv('MEMAGENT_DATA', str(tmp_path))
    assert shipped_data_dir() == tmp_path
    monkeypatch.setenv('MEMAGENT_DATA', str(tmp_path / 'missing'))
    with pytest.raises(FileNotFoundError, match='MEMAGENT_DATA'):
        shipped_data_dir()


def test_non_strict_counts_per_reason(tmp_path):
    src = _write_jsonl(tmp_path / 'in.jsonl', _bad_rows())
    m = convert(src, tmp_path / 'out.jsonl')
    assert m['skipped'] == {
        'malformed_json': 1,
        'missing_field': 1,
        'empty_context': 1,
        'bad_answers': 1,
        'duplicate_id': 1,
    }
    assert (m['rows_read'], m['rows_written'], m['rows_skipped']) == (7, 2, 5)
    assert m['rows_written'] + m['rows_skipped'] == m['rows_read']
    s = m['sources'][0]
    assert s['rows_written'] + s['rows_skipped'] == s['rows_read'] == 7 and len(s['sha256']) == 64
    assert m['output']['rows'] == 2 and m['output']['sha256']
    assert 'git' in m['provenance'] and m['params'] == {
        'fmt': 'auto',
        'strict': False,
        'limit': None,
    }
    assert json.loads((tmp_path / 'out.jsonl.manifest.json').read_text())['rows_read'] == 7
    assert [e['id'] for e in read_examples(tmp_path / 'out.jsonl')] == ['q1', 'q4']
    lines = {d['line']: d['reason'] for d in m['skipped_examples']}
    assert lines == {
        2: 'malformed_json',
        3: 'missing_field',
        4: 'empty_context',
        5: 'bad_answers',
        6: 'duplicate_id',
    }


@pytest.mark.parametrize(
    'bad,line,field,reason',
    [
        ('{"_id": ', 1, None, 'malformed_json'),
        ({k: v for k, v in ROW.items() if k != 'answer'}, 1, 'answer', 'missing_field'),
        ({**ROW, 'context': []}, 1, 'context', 'empty_context'),
        ({**ROW, 'context': [['A', ['', '  ']]]}, 1, 'context', 'empty_context'),
        ({**ROW, 'answer': ['Ann', 3]}, 1, 'answer', 'bad_answers'),
        ({**ROW, 'answer': []}, 1, 'answer', 'bad_answers'),
    ],
)
def test_strict_first_bad_row(tmp_path, bad, line, field, reason):
    src = _write_jsonl(tmp_path / 'in.jsonl', [bad, {**ROW, 'answer': 5}])
    with pytest.raises(DataError) as ei:
        convert(src, tmp_path / 'out.jsonl', strict=True)
    e = ei.value
    assert (
        (e.line, e.field) == (line, field)
        and e.reason.startswith(reason)
        and e.file.endswith('in.jsonl')
    )
    assert f'in.jsonl: line {line}' in str(e)
    assert not (tmp_path / 'out.jsonl').exists()


def test_strict_duplicate_id(tmp_path):
    src = _write_jsonl(tmp_path / 'in.jsonl', [ROW, {**ROW, '_id': 'q2'}, ROW])
    with pytest.raises(DataError, match=r"in.jsonl: line 3: field 'id': duplicate_id"):
        convert(src, tmp_path / 'o.jsonl', strict=True)


def test_limit_keeps_counts_consistent(tmp_path):
    src = _write_jsonl(tmp_path / 'in.jsonl', _bad_rows())
    m = convert(src, tmp_path / 'out.jsonl', limit=1)
    assert (m['rows_read'], m['rows_written'], m['rows_skipped']) == (1, 1, 0)


def test_hotpotqa_context_layout():
    ex = from_hotpotqa(ROW)
    assert ex['context'] == (
        'Document 1:\nA\nOne. Two.\n\nDocument 2:\nB\nAnn did it.\n\nDocument 3:\nC\nYes. Really.'
    )
    assert (
        ex['meta']['gold_slots'] == [2, 3]
        and ex['meta']['own_slots'] == [1, 2, 3]
        and ex['num_docs'] == 3
    )
    assert ex['id'] == 'q1' and ex['answers'] == ['Ann'] and ex['meta']['type'] == 'bridge'


RULER = [
    {
        '_id': 'r1',
        'input': 'Q1?',
        'context': 'Document 1:\nT\nx',
        'answers': ['a', 'b'],
        'num_docs': 1,
    },
    {
        '_id': 'r2',
        'input': 'Q2?',
        'context': 'Document 1:\nT\ny\n\nDocument 2:\nU\nz',
        'answers': ['c'],
    },
]


@pytest.mark.parametrize('kind', ['list', 'dict', 'jsonl'])
def test_ruler_inputs(tmp_path, kind):
    if kind == 'list':
        p = tmp_path / 'e.json'
        p.write_text(json.dumps(RULER))
    elif kind == 'dict':
        p = tmp_path / 'e.json'
        p.write_text(
            json.dumps({r['_id']: {k: v for k, v in r.items() if k != '_id'} for r in RULER})
        )
    else:
        p = _write_jsonl(tmp_path / 'e.jsonl', RULER)
    m = convert(p, tmp_path / 'o.jsonl.gz')
    assert m['sources'][0]['format'] == 'ruler' and m['rows_written'] == 2
    ex = read_examples(tmp_path / 'o.jsonl.gz')
    assert [e['id'] for e in ex] == ['r1', 'r2'] and [e['num_docs'] for e in ex] == [1, 2]
    assert (
        ex[0]['question'] == 'Q1?'
        and ex[0]['answers'] == ['a', 'b']
        and ex[0]['source'] == 'ruler_hqa'
    )


def test_ruler_bad_rows_json(tmp_path):
    p = tmp_path / 'e.json'
    p.write_text(
        json.dumps(
            [RULER[0], {**RULER[1], 'context': ''}, {**RULER[1], 'answers': [None]}, {'_id': 'r9'}]
        )
    )
    m = convert(p, tmp_path / 'o.jsonl')
    assert m['skipped'] == {'empty_context': 1, 'bad_answers': 1, 'missing_field': 1}
    with pytest.raises(DataError, match=r"e.json: item 2: field 'context': empty_context"):
        convert(p, tmp_path / 'o.jsonl', strict=True)
    p.write_text('[{"_id": 1,\n "input": }]')
    with pytest.raises(DataError, match='line 2'):
        convert(p, tmp_path / 'o.jsonl', fmt='ruler')


def test_parquet_input(tmp_path):
    pa = pytest.importorskip('pyarrow')
    pq = pytest.importorskip('pyarrow.parquet')
    rows = [
        {
            'data_source': 'hotpotqa',
            'prompt': [{'role': 'user', 'content': 'From prompt?'}],
            'context': 'ctx one',
            'ability': 'memory',
            'reward_model': {'style': 'rule', 'ground_truth': ['x', 'y']},
            'extra_info': {'index': 5, 'question': 'Real question?', 'num_docs': 3},
        },
        {
            'data_source': 'hotpotqa',
            'prompt': [{'role': 'user', 'content': 'From prompt?'}],
            'context': 'ctx two',
            'ability': 'memory',
            'reward_model': {'style': 'rule', 'ground_truth': ['z']},
            'extra_info': {'index': 6, 'question': None, 'num_docs': 2},
        },
        {
            'data_source': 'hotpotqa',
            'prompt': [{'role': 'user', 'content': 'Q?'}],
            'context': '',
            'ability': 'memory',
            'reward_model': {'style': 'rule', 'ground_truth': ['z']},
            'extra_info': {'index': 7, 'question': 'Q?', 'num_docs': 2},
        },
        {
            'data_source': 'hotpotqa',
            'prompt': [{'role': 'user', 'content': 'Q?'}],
            'context': 'c',
            'ability': 'memory',
            'reward_model': {'style': 'rule', 'ground_truth': []},
            'extra_info': {'index': 8, 'question': 'Q?', 'num_docs': 2},
        },
    ]
    p = tmp_path / 't.parquet'
    pq.write_table(pa.Table.from_pylist(rows), p)
    m = convert(p, tmp_path / 'o.jsonl')
    assert m['sources'][0]['format'] == 'parquet' and m['skipped'] == {
        'empty_context': 1,
        'bad_answers': 1,
    }
    ex = read_examples(tmp_path / 'o.jsonl')
    assert [(e['id'], e['question'], e['answers'], e['num_docs']) for e in ex] == [
        ('5', 'Real question?', ['x', 'y'], 3),
        ('6', 'From prompt?', ['z'], 2),
    ]
    with pytest.raises(DataError, match=r"t.parquet: row 3: field 'context'"):
        convert(p, tmp_path / 'o.jsonl', strict=True)


def test_read_examples_validates(tmp_path):
    good = {
        'id': 'a',
        'question': 'Q?',
        'context': 'c',
        'answers': ['x'],
        'num_docs': 1,
        'source': 's',
        'meta': {},
    }
    write_examples([good, {**good, 'id': 'b', 'answers': [1]}], tmp_path / 'x.jsonl')
    with pytest.raises(DataError, match=r"line 2: field 'answers'"):
        read_examples(tmp_path / 'x.jsonl')
    assert validate_example({**good, 'num_docs': -1}) == ('num_docs', 'must be an integer >= 0')


def _gz_rows(n=20000, schema=False):
    """n HotpotQA rows (or, with `schema`, the same rows converted to the schema) as gzip-compressed
    JSONL."""
    rows = [{**ROW, '_id': f'q{i}'} for i in range(n)]
    return gzip.compress(
        b''.join(b'%s\n' % json.dumps(from_hotpotqa(r) if schema else r).encode() for r in rows)
    )


@pytest.mark.parametrize('reader', ['read_examples', 'load_hotpotqa', 'convert'])
def test_truncated_gzip_names_file_and_line(tmp_path, reader):
    gz = _gz_rows(schema=reader == 'read_examples')
    p = tmp_path / 'cut.jsonl.gz'
    p.write_bytes(gz[: len(gz) // 2])
    call = {
        'read_examples': lambda: read_examples(p),
        'load_hotpotqa': lambda: load_hotpotqa(p),
        'convert': lambda: convert(p, tmp_path / 'o.jsonl'),
    }[reader]
    with pytest.raises(DataError) as e:
        call()
    assert e.value.file == str(p) and e.value.line > 1 and 'truncated gzip data' in str(e.value)
    assert re.search(r'cut\.jsonl\.gz: line \d+: truncated gzip data', str(e.value))
    assert not (tmp_path / 'o.jsonl').exists()


def test_gzip_mismatch_names_file(tmp_path):
    p = tmp_path / 'plain.jsonl.gz'
    p.write_text(json.dumps(ROW) + '\n')
    with pytest.raises(DataError, match=r'plain\.jsonl\.gz: line 1: not valid gzip data'):
        load_hotpotqa(p)
    q = tmp_path / 'packed.jsonl'
    q.write_bytes(_gz_rows(3))
    with pytest.raises(
        DataError, match=r'packed\.jsonl: line 1: gzip-compressed data in a file not named \.gz'
    ):
        read_examples(q)


def test_binary_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / 'bin.jsonl'
    p.write_bytes(json.dumps(ROW).encode() + b'\n' + bytes(range(128, 256)) + b'\n')
    with pytest.raises(
        DataError, match=r'bin\.jsonl: line 2: not UTF-8 text \(byte 0x80 at column 1\)'
    ):
        convert(p, tmp_path / 'o.jsonl')  # not skippable: the file is not text
    q = tmp_path / 'bin.json'
    q.write_bytes(b'[\n{"_id": "\xff"}]')
    with pytest.raises(DataError, match=r'bin\.json: line 2: not UTF-8 text'):
        convert(q, tmp_path / 'o.jsonl', fmt='ruler')
    r = _cli('convert_cli', p, tmp_path / 'o.jsonl', '--quiet')
    assert (
        r.returncode == 2
        and 'bin.jsonl: line 2: not UTF-8 text' in r.stderr
        and 'Traceback' not in r.stderr
    )


def test_corrupt_parquet_names_file(tmp_path):
    pa = pytest.importorskip('pyarrow')
    pq = pytest.importorskip('pyarrow.parquet')
    good = tmp_path / 'good.parquet'
    pq.write_table(pa.Table.from_pylist([{'context': 'c' * 50, 'i': i} for i in range(2000)]), good)
    b = good.read_bytes()
    p = tmp_path / 'cut.parquet'
    p.write_bytes(b[: len(b) // 2])
    with pytest.raises(DataError, match=r'cut\.parquet: not a readable parquet file'):
        convert(p, tmp_path / 'o.jsonl')
    bad = bytearray(b)
    bad[200:400] = b'\xff' * 200
    q = tmp_path / 'mid.parquet'
    q.write_bytes(bytes(bad))
    with pytest.raises(DataError, match=r'mid\.parquet: row 1: corrupt parquet data'):
        convert(q, tmp_path / 'o.jsonl', fmt='parquet')


def test_truncated_shipped_file_names_file(tmp_path):
    root = tmp_path / 'data'
    (root / 'hotpotqa').mkdir(parents=True)
    for rel in SHIPPED:
        (root / rel).write_bytes((shipped_data_dir() / rel).read_bytes())
    rel = 'hotpotqa/train_distractor.jsonl.gz'
    full = (root / rel).read_bytes()
    (root / rel).write_bytes(full[: len(full) // 2])
    with pytest.raises(ValueError, match=r'train_distractor\.jsonl\.gz: SHA-256 mismatch'):
        verify_shipped(root)


def test_limit_zero_means_zero_rows(tmp_path):
    good = {
        'id': 'a',
        'question': 'Q?',
        'context': 'c',
        'answers': ['x'],
        'num_docs': 1,
        'source': 's',
        'meta': {},
    }
    p = write_examples([good, {**good, 'id': 'b'}], tmp_path / 'x.jsonl')
    assert [len(read_examples(p, limit=n)) for n in (0, 1, 2, 3, None)] == [0, 1, 2, 2, 2]
    assert (
        load_hotpotqa(split='train', limit=0) == []
        and len(load_hotpotqa(split='train', limit=2)) == 2
    )
    assert convert(p, tmp_path / 'o.jsonl', limit=0)['rows_written'] == 0
    rows = load_hotpotqa(split='train', limit=3)
    assert build_haystack(rows, None, 30, limit=0) == []
    with pytest.raises(FileNotFoundError, match='no such file'):
        read_examples(tmp_path / 'missing.jsonl', limit=0)


@pytest.mark.parametrize(
    'call', ['read_examples', 'load_hotpotqa', 'build_haystack', 'convert', 'make_synthetic']
)
def test_negative_or_non_int_limits_refused(tmp_path, call):
    p = write_examples(
        [
            {
                'id': 'a',
                'question': 'Q?',
                'context': 'c',
                'answers': ['x'],
                'num_docs': 1,
                'source': 's',
                'meta': {},
            }
        ],
        tmp_path / 'x.jsonl',
    )
    rows = load_hotpotqa(split='train', limit=3)
    f = {
        'read_examples': lambda v: read_examples(p, limit=v),
        'load_hotpotqa': lambda v: load_hotpotqa(split='train', limit=v),
        'build_haystack': lambda v: build_haystack(rows, None, 30, limit=v),
        'convert': lambda v: convert(p, tmp_path / 'o.jsonl', limit=v),
        'make_synthetic': lambda v: make_synthetic(v, num_words=50),
    }[call]
    for v in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r'must be an int >= 0'):
            f(v)


@pytest.fixture(scope='module')
def dev():
    rows = load_hotpotqa(limit=150)
    return rows, doc_pool(rows)


def _docs(ctx):
    return re.split(r'(?:^|\n\n)Document \d+:\n', ctx)[1:]


def test_haystack_structure(dev):
    rows, pool = dev
    hs = build_haystack(rows[:5], pool, num_docs=40, seed=3)
    for e, q in zip(hs, rows):
        docs = _docs(e['context'])
        assert (
            len(docs) == 40 == e['num_docs'] == count_documents(e['context'])
            and len(set(docs)) == 40
        )
        assert re.findall(r'Document (\d+):', e['context']) == [str(i) for i in range(1, 41)]
        own = [paragraph_text(t, s) for t, s in q['context']]
        assert sorted(docs.index(d) + 1 for d in own) == e['meta']['own_slots']
        gold_titles = {t for t, _ in q['supporting_facts']}
        assert [i for i, d in enumerate(docs, 1) if d.split('\n', 1)[0] in gold_titles] == e[
            'meta'
        ]['gold_slots']
        assert len(e['meta']['gold_slots']) == 2 and set(e['meta']['gold_slots']) <= set(
            e['meta']['own_slots']
        )
        assert e['id'] == q['_id'] and e['answers'] == [q['answer']] and validate_example(e) is None


def test_haystack_shuffle_modes_and_seed(dev):
    rows, pool = dev
    qs = [q for q in rows if len(q['context']) == 10][:6]
    per = build_haystack(qs, pool, 30, seed=0)
    assert len({tuple(e['meta']['own_slots']) for e in per}) > 1
    off = build_haystack(qs, pool, 30, seed=0, shuffle='official')
    assert len({tuple(e['meta']['own_slots']) for e in off}) == 1
    assert build_haystack(qs, pool, 30, seed=0) == per
    assert build_haystack(qs, pool, 30, seed=1)[0]['context'] != per[0]['context']
    assert build_haystack(qs, pool, 30, seed=0, limit=2) == per[:2]
    with pytest.raises(ValueError, match='shuffle'):
        build_haystack(qs, pool, 30, shuffle='nope')
    with pytest.raises(ValueError, match='num_docs'):
        build_haystack(qs, pool, 5)
    with pytest.raises(ValueError, match='pool too small'):
        build_haystack(qs, pool[:15], 30)


@pytest.mark.parametrize('hops', [1, 2])
def test_synthetic(hops):
    exs = make_synthetic(6, num_words=300, hops=hops, seed=5, distractors=2)
    for e in exs:
        assert (
            validate_example(e) is None and e['source'] == 'synthetic' and e['meta']['hops'] == hops
        )
        assert e['answers'][0] in e['context'] and all(
            f in e['context'] for f in e['meta']['facts']
        )
        assert len(e['meta']['facts']) == hops == len(e['meta']['positions'])
        words = e['context'].split()
        for f, pos in zip(e['meta']['facts'], e['meta']['positions']):
            assert ' '.join(words[pos : pos + len(f.split())]) == f
        assert 300 <= e['meta']['num_words'] <= 300 + 12 * (hops + 2 * hops)
    assert make_synthetic(6, num_words=300, hops=hops, seed=5, distractors=2) == exs
    assert len({e['id'] for e in exs}) == 6
    fixed = make_synthetic(3, num_words=300, hops=hops, seed=1, positions=[0.5] * hops)
    assert all(abs(p - 150) <= 25 for e in fixed for p in e['meta']['positions'])
    with pytest.raises(ValueError):
        make_synthetic(1, num_words=100, hops=3)


def test_synthetic_num_tokens_without_tokenizer():
    e = make_synthetic(1, num_tokens=650, seed=0)[0]
    assert 450 <= e['meta']['num_words'] <= 550


def _cli(fn, *args):
    return subprocess.run(
        [
            sys.executable,
            '-c',
            f'import sys; from memagent.data import {fn}; sys.exit({fn}())',
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, 'PYTHONPATH': str(REPO)},
    )


def test_cli(tmp_path):
    src = _write_jsonl(tmp_path / 'in.jsonl', _bad_rows())
    r = _cli('convert_cli', src, tmp_path / 'o.jsonl', '--manifest', tmp_path / 'm.json')
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / 'm.json').read_text())['rows_skipped'] == 5
    r = _cli('convert_cli', src, tmp_path / 'o2.jsonl', '--strict', '--quiet')
    assert r.returncode == 2 and 'in.jsonl: line 2' in r.stderr and 'malformed_json' in r.stderr
    r = _cli('convert_cli', tmp_path / 'missing.jsonl', tmp_path / 'o3.jsonl', '--quiet')
    assert r.returncode == 2 and 'no such file' in r.stderr
    pool = _write_jsonl(tmp_path / 'pool.jsonl', load_hotpotqa(split='train', limit=12))
    r = _cli(
        'haystack_cli',
        pool,
        tmp_path / 'h.jsonl',
        '--num-docs',
        25,
        '--limit',
        3,
        '--shuffle',
        'official',
        '--seed',
        4,
    )
    assert r.returncode == 0, r.stderr
    ex = read_examples(tmp_path / 'h.jsonl')
    assert [e['num_docs'] for e in ex] == [25] * 3
    m = json.loads((tmp_path / 'h.jsonl.manifest.json').read_text())
    assert (
        m['params'] == {'num_docs': 25, 'seed': 4, 'shuffle': 'official', 'limit': 3}
        and m['output']['rows'] == 3
    )
    r = _cli('haystack_cli', pool, tmp_path / 'h2.jsonl', '--num-docs', 5000, '--quiet')
    assert r.returncode == 2 and 'pool too small' in r.stderr


def test_a_lone_surrogate_is_refused_at_read_time_naming_file_line_and_field(tmp_path, capsys):
    """JSON can escape a lone surrogate ("\\ud800"), which decodes to a str no UTF-8 writer accepts:
    the readers name the
        file, line and field at once (read_examples, memagent-evaluate with exit 2 and nothing
        written),
        and convert counts
        the row as skipped ('unencodable_text') or, strict, refuses it."""
    good = {
        'id': 'a',
        'question': 'Q?',
        'context': 'c',
        'answers': ['x'],
        'num_docs': 1,
        'source': 's',
        'meta': {},
    }
    p = tmp_path / 'x.jsonl'
    p.write_text(
        json.dumps(good)
        + '\n'
        + json.dumps({**good, 'id': 'b', 'meta': {'title': 'ok \ud800 here'}})
        + '\n'
    )
    assert '\\ud800' in p.read_text()  # the file itself is plain ASCII JSON
    with pytest.raises(
        DataError,
        match=(
            r"x.jsonl: line 2: field 'meta.title': not encodable as UTF-8: a lone surrogate "
            r"'\\ud800' at character 4"
        ),
    ):
        read_examples(p)
    assert validate_example({**good, 'answers': ['x', '\udfff']})[0] == 'answers[1]'
    from memagent.evaluate import evaluate_cli

    out = tmp_path / 'eval'
    assert (
        evaluate_cli(
            ['--model', 'tiny-qwen3', '--data', str(p), '--out', str(out), '--no-progress']
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "memagent-evaluate: error:" in err
        and "line 2: field 'meta.title'" in err
        and not out.exists()
    ), err
    src = _write_jsonl(tmp_path / 'h.jsonl', [ROW, {**ROW, '_id': 'q2', 'question': 'Who \udc80?'}])
    m = convert(src, tmp_path / 'o.jsonl')
    assert m['rows_written'] == 1 and m['skipped'] == {'unencodable_text': 1}, m
    assert (
        m['skipped_examples'][0]['field'] == 'question'
        and 'lone surrogate' in m['skipped_examples'][0]['detail']
    )
    with pytest.raises(DataError, match=r"h.jsonl: line 2: field 'question': unencodable_text"):
        convert(src, tmp_path / 'o2.jsonl', strict=True)
    assert not (tmp_path / 'o2.jsonl').exists()
