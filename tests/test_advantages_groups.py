"""The third AgeMem study's constructed groups: groups.json says what protocol.md says (its tables
and sentences are
parsed here, independently of the module), the expansion keeps the protocol's statements, and the
decisions of H1 to H10,
S1 to S3 and the probe rule follow the protocol on hand-made numbers."""

import copy, json, math, re
from pathlib import Path
from types import SimpleNamespace
import pytest
from memagent.advantages.groups import (
    GROUPS_SHA256,
    PROTOCOL_SHA256,
    GroupsError,
    load_groups,
    check_groups,
    episode_plans,
    episode_scripts,
    hypotheses,
    probe_decision,
    parsable_fraction,
    sampled_hypotheses,
    signs_differ,
    meets,
)
from memagent.stats import t_quantile, mean_interval
from memagent.provenance import sha256_file

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / 'reports' / 'agemem_advantages'
ALL4 = [(r, j) for r in ('official', 'observed') for j in ('off', 'on')]
BGS = ('b1', 'b2', 'b3', 'b4')


# ---- the protocol, read as text
# ------------------------------------------------------------------------------------


def _sections(text: str) -> dict:
    """`{heading: body}` of the protocol's `##` sections, and of its bold-lead paragraphs' tables
    kept in the body."""
    parts = re.split(r'^## ', text, flags=re.M)
    return {p.split('\n', 1)[0].strip(): p.split('\n', 1)[1] for p in parts[1:]}


def _tables(body: str) -> list:
    """Every markdown table in `body` as a list of rows of cells, header first, the separator row
    left out."""
    out, cur = [], []
    for line in body.splitlines() + ['']:
        if line.startswith('|'):
            cells = [c.strip() for c in line.strip()[1:-1].split('|')]
            if not all(set(c) <= set('- :') for c in cells):
                cur.append(cells)
        elif cur:
            out.append(cur)
            cur = []
    return out


def _ticks(cell: str) -> list:
    return re.findall(r'`([^`]*)`', cell)


def _flat(text: str) -> str:
    return ' '.join(text.split())


PROTO = (REPORT / 'protocol.md').read_text(encoding='utf-8')
SEC = _sections(PROTO)
CONSTRUCTED = SEC['Constructed groups']
HYPS = SEC['Hypotheses for the constructed groups']
T_TASK, T_REPLIES, T_BACKGROUNDS, T_GROUPS = _tables(CONSTRUCTED)
(T_HYP,) = _tables(HYPS)


@pytest.fixture(scope='module')
def groups():
    return load_groups(REPORT / 'groups.json')


def test_the_files_are_the_pinned_ones(groups):
    assert sha256_file(REPORT / 'protocol.md') == PROTOCOL_SHA256
    assert sha256_file(REPORT / 'groups.json') == GROUPS_SHA256
    assert groups['protocol'] == {'path': 'protocol.md', 'sha256': PROTOCOL_SHA256}


def test_the_task_is_the_protocols(groups):
    rows = {r[0]: r[1] for r in T_TASK[1:]}
    t = groups['task']
    assert t['question'] == _ticks(rows['question'])[0] and t['answer'] == _ticks(rows['answer'])[0]
    assert t['context']['title'] == _ticks(rows['context titles'])
    assert t['context']['sentences'] == [
        _ticks(part) for part in rows['context sentences'].split('; ')
    ]
    assert rows['supporting facts'] == 'none' and t['supporting_facts'] is None


def test_the_base_replies_are_the_protocols(groups):
    rows = {_ticks(r[0])[0]: r[1] for r in T_REPLIES[1:]}
    assert groups['replies'] == {name: _ticks(cell)[0] for name, cell in rows.items()}
    n = int(re.search(r'\(each of the (\d) distractors\)', rows['S2']).group(1))
    assert groups['base'] == {'stage1': ['S1'], 'distractors': n, 'distractor': ['S2']}
    assert (
        'Stage 1 has one round, each distractor one round, Stage 3 as its background says.'
        in CONSTRUCTED
    )


_ORDINAL = {'first': 0, 'second': 1, 'third': 2, 'fourth': 3, 'fifth': 4}


def _background(row) -> tuple:
    """A row of the backgrounds table read into the file's form: name, label, Stage-3 replies, the
    S3a and S3f places."""
    name, label = _ticks(row[0])[0], row[0].split('` ', 1)[1]
    reps = _ticks(row[1])
    if row[1].endswith('five times'):
        reps = reps * 5
    m = re.fullmatch(
        r'(inserted before|replaces the (\w+)|inserted between `\w+` and) `(\w+)`', row[2]
    )
    if m.group(1).startswith('replaces'):
        s3a = {'at': _ORDINAL[m.group(2)], 'mode': 'replace'}
    else:
        s3a = {'at': reps.index(m.group(3)), 'mode': 'insert'}
    assert reps[s3a['at']] == m.group(3)
    m = re.fullmatch(r'(?:the (\w+) )?`(\w+)`', row[3])
    s3f = _ORDINAL[m.group(1)] if m.group(1) else reps.index(m.group(2))
    assert reps[s3f] == m.group(2)
    return name, {'label': label, 'stage3': reps, 'S3a': s3a, 'S3f': s3f}


def test_the_backgrounds_are_the_protocols(groups):
    want = dict(_background(r) for r in T_BACKGROUNDS[1:])
    assert groups['backgrounds'] == want


def _where(cell: str) -> list:
    return {
        'an `S3a` round': ['S3a'],
        '`S3f`': ['S3f'],
        'Stage 1': ['stage1'],
        "the first distractor's reply": ['distractor1'],
        'Stage 1 and an `S3a` round': ['stage1', 'S3a'],
    }[cell]


def _variant(cell: str, replies: dict, read: dict) -> list:
    """A variant cell read into a list of changes' bodies, `{'reply': text}` or `{'prefix': text}`,
    one per slot."""
    out = []
    for part in cell.split(', and '):
        t = _ticks(part)
        if part.startswith('prefix `'):
            out.append({'prefix': t[0]})
        elif m := re.fullmatch(r'the same prefix with `(mem-\d\d)`', part):
            out.append({'prefix': re.sub(r'mem-\d\d', m.group(1), read['A'][0]['prefix'])})
        elif m := re.fullmatch(r"`(C\d)`'s variant (A|B)( prefix)?", part):
            out.append(dict(read[(m.group(1), m.group(2))][0]))
        elif part == '`S1`':
            out.append({'reply': replies['S1']})
        elif m := re.fullmatch(r'`S1` with (?:`"content": ""`|content `([^`]*)`)', part):
            out.append(
                {
                    'reply': re.sub(
                        r'"content": "[^"]*"',
                        lambda _: json.dumps({'content': m.group(1) or ''})[1:-1],
                        replies['S1'],
                    )
                }
            )
        else:
            assert len(t) == 1 and part == f'`{t[0]}`', part
            out.append({'reply': t[0]})
    return out


def test_the_six_groups_are_the_protocols(groups):
    read, want = {}, {}
    for row in T_GROUPS[1:]:
        g, title = _ticks(row[0])[0], row[0].split('` ', 1)[1]
        read['A'] = _variant(row[1], groups['replies'], read)
        read['B'] = _variant(row[2], groups['replies'], read)
        slots = _where(row[3])
        read[(g, 'A')], read[(g, 'B')] = read['A'], read['B']
        want[g] = {
            'title': title,
            'changes': {
                v: [{'slot': s, **body} for s, body in zip(slots, read[v], strict=True)]
                for v in 'AB'
            },
        }
    got = {
        g: {'title': s['title'], 'changes': {v: s['variants'][v]['changes'] for v in 'AB'}}
        for g, s in groups['groups'].items()
    }
    assert got == want
    # the two texts the protocol describes rather than quotes differ from S1 where it says
    c4b, c6b = (groups['groups'][g]['variants']['B']['changes'][0]['reply'] for g in ('C4', 'C6'))
    assert (
        '"content": ""' in c4b
        and "began from a harbour in 1851" in c6b
        and c4b != groups['replies']['S1']
    )


def test_experience_counts_order_and_task_ids_are_the_protocols(groups):
    text = _flat(CONSTRUCTED)
    m = re.search(
        r'every episode collects (\d) experiences: (\d) in Stage 1, (\d) in Stage 2, (\d) in '
        r'Stage 3',
        text,
    )
    base, s1, s2, s3 = map(int, m.groups())
    assert base == s1 + s2 + s3 and s2 == groups['base']['distractors']
    m = re.search(
        r"so A's episodes collect (\d) experiences and B's (\d)\. In `C6` every episode collects "
        r"(\d)\.",
        text,
    )
    want = {g: {'A': base, 'B': base} for g in groups['groups']}
    want['C1'] = {'A': int(m.group(1)), 'B': int(m.group(2))}
    want['C6'] = {'A': int(m.group(3)), 'B': int(m.group(3))}
    assert {
        g: {v: s['variants'][v]['experiences'] for v in 'AB'} for g, s in groups['groups'].items()
    } == want
    m = re.search(
        r'Episodes are ordered ((?:[AB]-b\d, )+[AB]-b\d); each group is task `0/<group>`', text
    )
    assert groups['order'] == [p.split('-') for p in m.group(1).split(', ')]
    assert groups['task_id'] == '0/{group}'


def _cell(text: str) -> dict:
    "A Δ cell of the hypotheses table read into `{background: expected}`."
    out = {}
    for part in text.split('; '):
        m = re.fullmatch(
            r'(\[(-?[\d.]+), (-?[\d.]+)\]|tie|exactly 0) (every background|in (`b\d`(?:, `b\d`)*))',
            part,
        )
        assert m, part
        e = (
            {'interval': [float(m.group(2)), float(m.group(3))]}
            if m.group(2)
            else {'tie': True}
            if m.group(1) == 'tie'
            else {'exact': 0.0}
        )
        for b in BGS if m.group(4) == 'every background' else _ticks(m.group(5)):
            assert b not in out
            out[b] = e
    return {b: out[b] for b in BGS}


def test_the_delta_hypotheses_are_the_protocols_table(groups):
    assert T_HYP[0] == ['id', 'group', 'judge', 'official Δ', 'observed Δ', 'reason']
    want = [
        {
            'id': r[0],
            'group': _ticks(r[1])[0],
            'judges': {'off': ['off'], 'on': ['on'], 'both': ['off', 'on']}[r[2]],
            'official': _cell(r[3]),
            'observed': _cell(r[4]),
            'reason': r[5],
        }
        for r in T_HYP[1:]
    ]
    assert groups['hypotheses']['deltas'] == want
    text = _flat(HYPS)
    assert 'A tie is |Δ| < 0.001;' in text and groups['hypotheses']['tie_below'] == 0.001
    assert (
        'An interval [x, y] is met when x ≤ Δ ≤ y. Each hypothesis holds when every stated cell '
        'meets it' in text
    )


def test_h7_and_h8_are_the_protocols(groups):
    text = _flat(HYPS)
    assert (
        'In every group, under all four rewards and both normalisations, every `b1` and `b4` '
        'episode has a positive advantage and every `b3` episode a negative one.'
    ) in text
    h7 = groups['hypotheses']['H7']
    assert (h7['groups'], [tuple(x) for x in h7['rewards']], h7['positive'], h7['negative']) == (
        list(groups['groups']),
        ALL4,
        ['b1', 'b4'],
        ['b3'],
    )
    assert (
        'the `b2` episode of the variant with the higher reward has a positive advantage and the '
        'other a negative one, under both normalisations'
    ) in text
    m = re.search(r'The cells: (.*?)\. - \*\*H9', text)
    want = set()
    for part in m.group(1).split('; '):
        gs = [x for x in _ticks(part) if re.fullmatch(r'C\d', x)]
        if 'all four' in part:
            cells = ALL4
        else:
            rs = (
                ['official', 'observed']
                if 'both rewards' in part
                else [r for r in ('official', 'observed') if r in part]
            )
            js = (
                ['off', 'on']
                if 'judge off and on' in part
                else ['on']
                if 'judge on' in part
                else None
            )
            cells = [(r, j) for r in rs for j in js]
        want |= {(g, r, j) for g in gs for r, j in cells}
    got = [tuple(c) for c in groups['hypotheses']['H8']['cells']]
    assert (
        len(got) == len(set(got))
        and set(got) == want
        and groups['hypotheses']['H8']['background'] == 'b2'
    )


def test_h9_and_h10_are_the_protocols(groups):
    text = _flat(HYPS)
    said = [
        (
            'is exactly 2/8 in `C5`, both `b2` episodes, judge off and on.',
            [{'group': 'C5', 'judges': ['off', 'on'], 'exactly': 2, 'only': ['b2']}],
        ),
        (
            'It is 0 in `C1`, and in `C6` with the judge on.',
            [
                {'group': 'C1', 'judges': ['off', 'on'], 'exactly': 0, 'only': []},
                {'group': 'C6', 'judges': ['on'], 'exactly': 0, 'only': []},
            ],
        ),
        (
            'It is exactly 1/8 in `C4`, a `b2` episode, judge off and on.',
            [{'group': 'C4', 'judges': ['off', 'on'], 'exactly': 1, 'only': ['b2']}],
        ),
        # read as the sentence before it reads: the judge setting qualifies C6 alone (C6 with the
        # judge on is stated above)
        (
            'In `C2`, `C3` and `C6` with the judge off it is at most 2/8, and only `b2` episodes '
            'disagree.',
            [
                {'group': 'C2', 'judges': ['off', 'on'], 'at_most': 2, 'only': ['b2']},
                {'group': 'C3', 'judges': ['off', 'on'], 'at_most': 2, 'only': ['b2']},
                {'group': 'C6', 'judges': ['off'], 'at_most': 2, 'only': ['b2']},
            ],
        ),
    ]
    for sentence, _ in said:
        assert sentence in text, sentence
    assert '(same judge setting, same normalisation)' in text
    assert groups['hypotheses']['H9']['cells'] == [c for _, cs in said for c in cs]
    covered = [(c['group'], j) for c in groups['hypotheses']['H9']['cells'] for j in c['judges']]
    # each group and setting once
    assert sorted(covered) == sorted((g, j) for g in groups['groups'] for j in ('off', 'on'))
    assert (
        '(`C2` to `C5`: n = 5; `C6`: n = 6), each per-experience advantage equals the per-episode '
        'one times sqrt((8n - 1) / (7n)), within a relative 1e-4.'
    ) in text
    assert (
        "In `C1`, where A collects 6 and B 5, no episode's sign differs between the two "
        "normalisations." in text
    )
    assert groups['hypotheses']['H10'] == {
        'equal': {'C2': 5, 'C3': 5, 'C4': 5, 'C5': 5, 'C6': 6},
        'relative': 1e-4,
        'same_sign': ['C1'],
    }
    for g, n in groups['hypotheses']['H10']['equal'].items():
        assert {s['experiences'] for s in groups['groups'][g]['variants'].values()} == {n}


# ---- the expansion
# --------------------------------------------------------------------------------------------------


def _stages(ep):
    "Reply counts of one episode: Stage 1, each distractor, Stage 3."
    r = ep['replies']
    return (
        sum(x['stage'] == 1 for x in r),
        [sum(x['stage'] == 2 and x['distractor'] == d for x in r) for d in range(3)],
        sum(x['stage'] == 3 for x in r),
    )


def test_the_expansion_keeps_the_protocols_statements(groups):
    plans, R = episode_plans(groups), groups['replies']
    assert groups['episodes'] == plans  # the stored scripts are the expansion
    assert list(plans) == ['C1', 'C2', 'C3', 'C4', 'C5', 'C6'] and all(
        len(eps) == 8 for eps in plans.values()
    )
    stage3 = {'b1': 1, 'b2': 1, 'b3': 5, 'b4': 2}
    for g, eps in plans.items():
        for i, ep in enumerate(eps):
            assert (ep['episode'], ep['task_id']) == (i, f'0/{g}')
            assert [(x['stage'], x['distractor']) for x in ep['replies']] == sorted(
                [(x['stage'], x['distractor']) for x in ep['replies']],
                key=lambda s: (s[0], -1 if s[1] is None else s[1]),
            )
            # an S3a round is inserted, except in b3 where it replaces
            extra = g in ('C1', 'C6') and ep['background'] != 'b3'
            assert _stages(ep) == (1, [1, 1, 1], stage3[ep['background']] + extra), (g, i)
    by = {
        (g, e['variant'], e['background']): [x['text'] for x in e['replies']]
        for g, eps in plans.items()
        for e in eps
    }
    # a base episode: S1, S2 three times, then the background's Stage 3
    assert by[('C3', 'A', 'b3')][:4] == [R['S1']] + [R['S2']] * 3
    # b3 has five Stage-3 replies, the fifth carrying S3f's prefix; C1-A's S3a replaces the first
    assert by[('C2', 'B', 'b3')][4:] == [R['UNSURE']] * 4 + [
        groups['groups']['C2']['variants']['B']['changes'][0]['prefix'] + R['UNSURE']
    ]
    c1a = groups['groups']['C1']['variants']['A']['changes'][0]['reply']
    assert by[('C1', 'A', 'b3')][4:] == [c1a] + [R['UNSURE']] * 4
    # C1-A adds an S3a round: before RIGHT in b1, between PLAIN and RIGHT in b4
    assert by[('C1', 'A', 'b1')][4:] == [c1a, R['RIGHT']] and by[('C1', 'A', 'b4')][4:] == [
        R['PLAIN'],
        c1a,
        R['RIGHT'],
    ]
    assert by[('C6', 'B', 'b2')][4:] == [c1a, R['WRONG']]
    # C5 changes the first distractor's reply and nothing else
    for v in 'AB':
        for b in BGS:
            got, base = by[('C5', v, b)], by[('C4', 'A', b)]
            assert (
                got[1] == groups['groups']['C5']['variants'][v]['changes'][0]['reply']
                and got[:1] + got[2:] == base[:1] + base[2:]
            )
    # C4 and C6 change Stage 1 only (C6 also its S3a round)
    assert (
        by[('C4', 'B', 'b1')][1:] == by[('C4', 'A', 'b1')][1:]
        and by[('C4', 'B', 'b1')][0] != R['S1']
    )
    assert episode_scripts(groups) == {
        g: [[x['text'] for x in e['replies']] for e in eps] for g, eps in plans.items()
    }


def test_each_variant_differs_from_the_base_only_where_its_change_goes(groups):
    from memagent.advantages.groups import episode_replies

    g0 = copy.deepcopy(groups)
    g0['groups']['C0'] = {
        'title': 'no change',
        'variants': {'A': {'changes': [], 'experiences': 5}},
    }
    for g, spec in groups['groups'].items():
        for v, var in spec['variants'].items():
            for b, bg in groups['backgrounds'].items():
                base = [x['text'] for x in episode_replies(g0, 'C0', 'A', b)]
                got = [x['text'] for x in episode_replies(groups, g, v, b)]
                slots = {c['slot']: c for c in var['changes']}
                if 'S3a' in slots:
                    at = 4 + bg['S3a']['at']
                    assert got[at] == slots['S3a']['reply']
                    if bg['S3a']['mode'] == 'insert':
                        del got[at]
                    else:
                        got[at] = base[at]
                where = {'stage1': 0, 'distractor1': 1, 'S3f': 4 + bg['S3f']}
                for slot, i in where.items():
                    if slot in slots:
                        c = slots[slot]
                        assert got[i] == (c['reply'] if 'reply' in c else c['prefix'] + base[i]), (
                            g,
                            v,
                            b,
                            slot,
                        )
                        got[i] = base[i]
                assert got == base, (g, v, b)


# ---- loading
# --------------------------------------------------------------------------------------------------


def test_load_groups_refuses_an_edited_file(tmp_path, groups):
    p = tmp_path / 'groups.json'
    p.write_text(json.dumps(groups) + '\n')
    with pytest.raises(GroupsError, match=r'groups.json: SHA-256 \w+ is not the committed one'):
        load_groups(p)
    assert load_groups(p, pinned=False) == groups
    with pytest.raises(GroupsError, match='no such file'):
        load_groups(tmp_path / 'none.json')


@pytest.mark.parametrize(
    'edit, key',
    [
        (
            lambda d: d['episodes']['C5'][0]['replies'].pop(),
            "episodes.C5[0]: differs from what the compact form builds in ['replies']",
        ),
        (
            lambda d: d['replies'].update(RIGHT='<answer>Gull Point</answer>'),
            "episodes.C1[0]: differs",
        ),
        (
            lambda d: d['groups']['C3']['variants']['A']['changes'][0].update(slot='S3x'),
            'groups.C3.variants.A.changes[0]: names no slot',
        ),
        (
            lambda d: d['groups']['C1']['variants']['A']['changes'][0].update(prefix='x'),
            "groups.C1.variants.A.changes[0]: has not exactly one",
        ),
        (
            lambda d: d['groups']['C6']['variants']['B']['changes'].append(
                {'slot': 'S3a', 'reply': 'x'}
            ),
            'groups.C6.variants.B.changes: changes one slot twice',
        ),
        (
            lambda d: d['backgrounds']['b4']['S3a'].update(mode='replace', at=2),
            'backgrounds.b4.S3a',
        ),
        (
            lambda d: d['task'].update(supporting_facts={'title': [], 'sent_id': []}),
            'task.supporting_facts: is not null',
        ),
        (lambda d: d['task']['context']['sentences'].pop(), 'task.context: is not'),
        (lambda d: d['order'].pop(), 'order: is not each variant with each background once'),
        (
            lambda d: d['hypotheses']['deltas'][2]['official']['b3'].update(interval=[0.1, 0.2]),
            'hypotheses.deltas[2].official.b3',
        ),
        (
            lambda d: d['hypotheses']['deltas'][0]['observed']['b1'].update(
                interval=[0.058, 0.056]
            ),
            'hypotheses.deltas[0].observed.b1',
        ),
        (
            lambda d: d['hypotheses']['H8']['cells'].append(['C7', 'official', 'on']),
            'hypotheses.H8',
        ),
        (lambda d: d['hypotheses']['H9']['cells'][0].update(at_most=2), 'hypotheses.H9'),
        (lambda d: d.update(schema='other/1'), "schema: is 'other/1'"),
    ],
)
def test_check_groups_names_the_key(groups, edit, key):
    d = copy.deepcopy(groups)
    edit(d)
    with pytest.raises(GroupsError) as e:
        check_groups(d, 'g.json')
    assert str(e.value).startswith('g.json: ') and key in str(e.value), str(e.value)


# ---- H1 to H10 on hand-made results
# -----------------------------------------------------------------------------------

# about the official levels the protocol's groups reach
LEVELS = {
    'b1': 0.62,
    'b2': 0.12,
    'b3': -0.88,
    'b4': 0.60,
}
NORMS = ('per_experience', 'per_episode')


def _grpo(totals, counts):
    """The protocol's statement of upstream's advantage: (reward - mean) / (std + 1e-6), unbiased
    std over every experience."""
    xs = [t for t, c in zip(totals, counts) for _ in range(c)]
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return [(t - m) / (s + 1e-6) for t in totals]


def _mid(c):
    return sum(c['interval']) / 2 if 'interval' in c else 0.0002 if c.get('tie') else c['exact']


def _advantages(eps):
    for r in ('official', 'observed'):
        for j in ('off', 'on'):
            totals = [e['rewards'][r][j] for e in eps]
            for n, counts in (
                ('per_experience', [e['experiences'] for e in eps]),
                ('per_episode', [1] * len(eps)),
            ):
                for e, a in zip(eps, _grpo(totals, counts)):
                    e['advantages'][r][j][n] = a
    return eps


def made(groups, delta=None):
    """Episodes whose Δ sits at the middle of each stated cell (a tie at 0.0002), or at
    `delta[(group, reward, judge, background)]`."""
    d = {
        (h['group'], r, j, b): _mid(h[r][b])
        for h in groups['hypotheses']['deltas']
        for j in h['judges']
        for r in ('official', 'observed')
        for b in BGS
    }
    d.update(delta or {})
    out = {}
    for g, spec in groups['groups'].items():
        out[g] = _advantages(
            [
                {
                    'group': g,
                    'variant': v,
                    'background': b,
                    'experiences': spec['variants'][v]['experiences'],
                    'rewards': {
                        r: {
                            j: LEVELS[b] + 0.075 * (r == 'observed') + (v == 'A') * d[(g, r, j, b)]
                            for j in ('off', 'on')
                        }
                        for r in ('official', 'observed')
                    },
                    'advantages': {
                        r: {j: {} for j in ('off', 'on')} for r in ('official', 'observed')
                    },
                }
                for v, b in groups['order']
            ]
        )
    return out


def verdicts(by, groups):
    return {h['id']: h['held'] for h in hypotheses(by, groups)}


IDS = ['H1', 'H1j', 'H2', 'H3', 'H4', 'H4j', 'H5', 'H6', 'H6j', 'H7', 'H8', 'H9', 'H10']


def test_every_hypothesis_holds_on_results_that_meet_every_cell(groups):
    res = hypotheses(made(groups), groups)
    assert [h['id'] for h in res] == IDS and all(h['held'] for h in res)
    cells = {h['id']: h['cells'] for h in res}
    assert (
        len(cells['H1']) == 8
        and len(cells['H2']) == 16
        and len(cells['H7']) == 6 * 4 * 2
        and len(cells['H8']) == 16
    )
    assert [c['differ'] for c in cells['H9'] if c['group'] == 'C5'] == [['A-b2', 'B-b2']] * 4
    assert [c['differ'] for c in cells['H9'] if c['group'] == 'C4'] == [['B-b2']] * 4
    assert {c['n']: round(c['factor'], 5) for c in cells['H10'] if 'n' in c} == {
        5: 1.0556,
        6: 1.05785,
    }
    json.dumps(res, allow_nan=False)  # the receipt can hold them


@pytest.mark.parametrize(
    'cell, value, turns',
    [
        (('C1', 'official', 'off', 'b3'), 0.0181, ['H1']),  # just outside [0.016, 0.018]
        (('C1', 'official', 'off', 'b3'), 0.0161, []),
        (('C1', 'observed', 'on', 'b2'), 0.0829, []),
        (('C1', 'observed', 'on', 'b2'), 0.0831, ['H1j']),
        (('C2', 'official', 'on', 'b4'), -0.0009, []),  # |Δ| < 0.001 is a tie
        (('C2', 'official', 'on', 'b4'), 0.0011, ['H2']),
        (('C3', 'observed', 'off', 'b1'), 0.0015, ['H3']),
        (('C4', 'official', 'off', 'b2'), 1e-12, ['H4']),  # H4: exactly 0, not nearly
        (('C4', 'official', 'on', 'b1'), -1e-12, ['H4j']),
        (('C5', 'observed', 'on', 'b3'), 0.0889, ['H5']),
        (('C6', 'observed', 'off', 'b2'), 0.0012, ['H6']),
        (('C6', 'official', 'on', 'b2'), 0.052, ['H6j']),
    ],
)
def test_one_number_outside_its_cell_turns_its_hypothesis(groups, cell, value, turns):
    v = verdicts(made(groups, {cell: value}), groups)
    assert [k for k in IDS if not v[k]] == turns


def test_h7_needs_every_sign(groups):
    by = made(groups)
    by['C3'][6]['advantages']['observed']['on']['per_episode'] = 0.0  # B-b3 must be < 0
    v = verdicts(by, groups)
    # H9 reads the same sign, H10 the ratio
    assert [k for k in IDS if not v[k]] == [
        'H7',
        'H9',
        'H10',
    ]


def test_h8_needs_the_tie_band_crossed_in_every_background_and_the_b2_signs(groups):
    by = made(groups, {('C5', 'official', 'off', 'b4'): 0.0005})  # one background inside the band
    res = {h['id']: h for h in hypotheses(by, groups)}
    assert not res['H8']['held'] and not res['H5']['held']
    bad = [c for c in res['H8']['cells'] if not c['met']]
    assert [(c['group'], c['reward'], c['judge'], c['outside_tie']) for c in bad] == [
        ('C5', 'official', 'off', False)
    ]
    by = made(groups)
    by['C2'][5]['advantages']['observed']['off']['per_experience'] = (
        0.01  # B-b2 under observed must be < 0 (A is higher)
    )
    res = {h['id']: h for h in hypotheses(by, groups)}
    assert [(c['group'], c['higher']) for c in res['H8']['cells'] if not c['met']] == [('C2', 'A')]


@pytest.mark.parametrize(
    'g, i, judge, turns',
    [
        ('C5', 5, 'on', True),  # B-b2 agrees: 1/8, not exactly 2/8
        ('C1', 1, 'off', True),  # A-b2 disagrees: not 0
        ('C4', 1, 'on', True),  # both b2 episodes: 2/8, not exactly 1/8
        ('C4', 2, 'off', True),  # a b3 episode disagrees
        ('C6', 1, 'on', True),  # not 0 with the judge on
        ('C6', 1, 'off', False),  # with the judge off, one b2 episode is allowed
    ],
)
def test_h9_counts_exactly(groups, g, i, judge, turns):
    by = made(groups)
    e = by[g][i]['advantages']
    o = e['observed'][judge]['per_episode']
    e['official'][judge]['per_episode'] = (
        o if signs_differ(e['official'][judge]['per_episode'], o) else -o
    )
    h9 = next(h for h in hypotheses(by, groups) if h['id'] == 'H9')
    assert [(c['group'], c['judge'], c['normalisation']) for c in h9['cells'] if not c['met']] == (
        [(g, judge, 'per_episode')] if turns else []
    )


def test_h9_at_most_two_and_only_b2(groups):
    by = made(groups)  # C2: both b2 episodes, 2/8 is allowed
    for i in (1, 5):
        by['C2'][i]['advantages']['observed']['off']['per_episode'] = -abs(
            by['C2'][i]['advantages']['official']['off']['per_episode']
        )
    c = [
        c
        for c in next(h for h in hypotheses(by, groups) if h['id'] == 'H9')['cells']
        if c['group'] == 'C2' and c['judge'] == 'off' and c['normalisation'] == 'per_episode'
    ][0]
    assert (c['differ'], c['fraction'], c['met']) == (['A-b2', 'B-b2'], 0.25, True)
    # a b1 episode disagrees: only b2 may
    by['C2'][0]['advantages']['observed']['off']['per_episode'] = -1.0
    c = [
        c
        for c in next(h for h in hypotheses(by, groups) if h['id'] == 'H9')['cells']
        if c['group'] == 'C2' and c['judge'] == 'off' and c['normalisation'] == 'per_episode'
    ][0]
    assert (c['differ'], c['met']) == (['A-b1', 'A-b2', 'B-b2'], False)


def test_h10_factor_within_a_relative_1e_4(groups):
    n = 5
    f = math.sqrt((8 * n - 1) / (7 * n))
    for scale, held in ((1 + 0.9e-4, True), (1 + 1.1e-4, False), (1 - 1.1e-4, False)):
        by = made(groups)
        e = by['C3'][2]['advantages']['official']['off']
        e['per_experience'] = e['per_episode'] * f * scale
        assert verdicts(by, groups)['H10'] is held
    by = made(groups)
    by['C6'][0]['experiences'] = 5  # C6 collects 6 in every episode
    assert verdicts(by, groups)['H10'] is False
    by = made(groups)
    e = by['C1'][5]['advantages']['observed']['on']  # C1: a sign differs between the normalisations
    e['per_experience'] = -e['per_episode']
    h10 = next(h for h in hypotheses(by, groups) if h['id'] == 'H10')
    assert [c['differ'] for c in h10['cells'] if not c['met']] == [['B-b2']]


def test_a_lost_group_turns_what_reads_it_and_a_malformed_one_is_refused(groups):
    by = made(groups)
    v = verdicts({**by, 'C5': None}, groups)
    assert [k for k in IDS if not v[k]] == ['H5', 'H7', 'H8', 'H9', 'H10']
    v = verdicts({g: e for g, e in by.items() if g != 'C2'}, groups)
    assert [k for k in IDS if not v[k]] == ['H2', 'H7', 'H8', 'H9', 'H10']
    bad = copy.deepcopy(by)
    bad['C1'].pop()
    with pytest.raises(ValueError, match=r"episodes of C1: \['B-b4'\] missing"):
        hypotheses(bad, groups)
    bad = copy.deepcopy(by)
    bad['C1'][0]['rewards']['official']['on'] = None
    with pytest.raises(ValueError, match='episode C1 A-b1: rewards.official.on is None'):
        hypotheses(bad, groups)
    bad = copy.deepcopy(by)
    bad['C1'][1]['background'] = 'b1'
    with pytest.raises(ValueError, match='two episodes A-b1'):
        hypotheses(bad, groups)


def test_meets_reads_the_bounds_as_the_protocol_states():
    tie = 0.001
    # x <= Δ <= y
    assert meets(0.016, {'interval': [0.016, 0.018]}, tie) and meets(
        0.018, {'interval': [0.016, 0.018]}, tie
    )
    assert not meets(0.0180001, {'interval': [0.016, 0.018]}, tie) and meets(
        -0.051, {'interval': [-0.051, -0.049]}, tie
    )
    # |Δ| < 0.001
    assert meets(0.000999, {'tie': True}, tie) and meets(-0.000999, {'tie': True}, tie)
    assert not meets(0.001, {'tie': True}, tie) and not meets(-0.001, {'tie': True}, tie)
    assert (
        meets(0.0, {'exact': 0.0}, tie)
        and meets(-0.0, {'exact': 0.0}, tie)
        and not meets(5e-324, {'exact': 0.0}, tie)
    )
    assert not any(
        meets(None, c, tie) for c in ({'tie': True}, {'exact': 0.0}, {'interval': [0, 1]})
    )


def test_signs_differ():
    assert (
        signs_differ(0.1, -0.1)
        and signs_differ(0.0, 0.1)
        and not signs_differ(-2.0, -0.1)
        and not signs_differ(0.0, 0.0)
    )


# ---- the probe, its rule, the sampled hypotheses
# ----------------------------------------------------------------------

NAMES = (
    'Summary_context',
    'Clear_context',
    'Retrieve_memory',
    'Add_memory',
    'Update_memory',
    'Delete_memory',
)


def _parse(text):
    """The standard `<tool_call>[...]</tool_call>` form only: a stand-in for upstream's parser where
    the checkout is absent."""
    return [
        c
        for m in re.finditer(r'<tool_call>\s*(\[.*?\])\s*</tool_call>', text, re.S)
        for c in json.loads(m.group(1))
    ]


MODS = {
    'utils': SimpleNamespace(
        TOOL_SCHEMA=[{'name': n, 'description': '', 'parameters': {}} for n in NAMES],
        parse_tool_calls=_parse,
    )
}
CASES = [
    ('<tool_call>[{"name": "Add_memory", "arguments": {"content": "x"}}]</tool_call>', True),
    ('<tool_call>[{"name": "Clear_context"}]</tool_call>', True),  # arguments absent
    (
        '<tool_call>[{"name": "Add_memory", "arguments": "x"}]</tool_call>',
        False,
    ),  # arguments not an object
    ('<tool_call>[{"name": "Add_memory", "arguments": ["x"]}]</tool_call>', False),
    (
        '<tool_call>[{"name": "add_memory", "arguments": {}}]</tool_call>',
        False,
    ),  # no TOOL_SCHEMA name
    ('<tool_call>["Add_memory", 3, null]</tool_call>', False),  # not objects
    ('<tool_call>["Add_memory", {"name": "Delete_memory", "arguments": {}}]</tool_call>', True),
    ('I would call Update_memory here.', False),
    ('', False),
]


def test_parsable_fraction_with_the_parser_passed_in():
    assert parsable_fraction([t for t, _ in CASES], MODS) == sum(ok for _, ok in CASES) / len(CASES)
    for t, ok in CASES:
        assert parsable_fraction([t], MODS) == float(ok), t
    assert parsable_fraction([{'text': CASES[0][0]}, {'text': ''}], MODS) == 0.5
    assert parsable_fraction([], MODS) == 0.0
    # `parse` replaces the module's parser
    assert parsable_fraction([CASES[0][0]], MODS, parse=lambda text: []) == 0.0


def test_parsable_fraction_with_upstreams_parser():
    import os

    src = os.environ.get('AGEMEM_SRC')
    if not src:
        pytest.skip('no upstream checkout (AGEMEM_SRC)')
    from memagent.observed.store import load_upstream

    mods = load_upstream(src)
    assert {t['name'] for t in mods['utils'].TOOL_SCHEMA} == set(NAMES)
    for t, ok in CASES:
        assert parsable_fraction([t], mods) == float(ok), t
    # upstream also reads an unclosed block, which the stand-in does not
    assert (
        parsable_fraction(
            ['<tool_call>[{"name": "Retrieve_memory", "arguments": {"query": "x"}}'], mods
        )
        == 1.0
    )


@pytest.mark.parametrize(
    't_probe, p, groups_n, run',
    [
        (168.75, 0.20, 2, True),  # 2700 / (8 x 168.75) = 2 exactly
        (168.76, 0.90, 1, False),  # N < 2
        (33.75, 0.20, 8, True),  # 10 by the budget, capped at 8
        (10.0, 0.1999, 8, False),  # p < 0.20
        (1000.0, 0.0, 0, False),
    ],
)
def test_probe_decision(t_probe, p, groups_n, run):
    d = probe_decision(t_probe, p, replies=25)
    assert (d['groups'], d['run'], d['replies'], d['threshold']) == (groups_n, run, 25, 0.2)
    assert d['why'] == ('p >= 0.20 and N = %d >= 2' % groups_n if run else d['why'])
    if not run:
        assert ('below 0.20' in d['why']) == (p < 0.2) and ('below 2' in d['why']) == (groups_n < 2)


def test_probe_decision_refuses_nonsense():
    for t, p in ((0, 0.5), (-1, 0.5), (float('nan'), 0.5), (10, 1.5), (10, True)):
        with pytest.raises(ValueError):
            probe_decision(t, p)


def test_t_quantile_against_references():
    for df, want in (
        (1, 12.7062047362),
        (2, 4.3026527297),
        (3, 3.1824463053),
        (4, 2.7764451052),
        (5, 2.5705818356),
        (6, 2.4469118511),
        (7, 2.3646242516),
        (8, 2.3060041352),
        (15, 2.1314495456),
        (63, 1.9983405425),
    ):
        assert abs(t_quantile(0.975, df) - want) < 1e-8, df
    assert abs(t_quantile(0.975, 1) - math.tan(math.pi * 0.475)) < 1e-9
    assert abs(t_quantile(0.975, 2) - 0.95 / math.sqrt(2 * 0.975 * 0.025)) < 1e-9
    assert (
        abs(t_quantile(0.995, 10) - 3.1692726726) < 1e-8
        and abs(t_quantile(0.025, 12) + 2.1788128297) < 1e-8
    )
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_t_quantile_against_mpmath():
    mpmath = pytest.importorskip('mpmath')
    for df in (1, 2, 3, 5, 11, 23, 47, 63, 127):
        for q in (0.6, 0.9, 0.975, 0.999):
            start = 1.05 * t_quantile(q, df) + 0.1  # near, not at, the root: findroot finds its own
            want = mpmath.findroot(
                lambda t: (
                    1 - mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True) / 2 - q
                ),
                start,
            )
            assert abs(t_quantile(q, df) - float(want)) < 1e-8 * max(1, float(want)), (df, q)


def _sampled(diffs, shows=('prose:Retrieve_memory',)):
    return [
        {
            'behaviours': list(shows),
            'advantages': {
                'official': {j: {n: 0.5 + d for n in NORMS} for j in ('off', 'on')},
                'observed': {j: {n: 0.5 for n in NORMS} for j in ('off', 'on')},
            },
        }
        for d in diffs
    ]


def test_mean_interval():
    iv = mean_interval([0.2, 0.25, 0.3])
    assert iv['n'] == 3 and abs(iv['mean'] - 0.25) < 1e-12 and abs(iv['sd'] - 0.05) < 1e-12
    assert (
        abs(iv['low'] - (0.25 - 4.3026527297 * 0.05 / math.sqrt(3))) < 1e-9
        and abs(iv['high'] + iv['low'] - 0.5) < 1e-12
    )
    assert mean_interval([1.0, 2.0]) is None and mean_interval([]) is None


def test_sampled_hypotheses():
    s1, s2, s3 = sampled_hypotheses(_sampled([0.2, 0.25, 0.3]))
    assert (s1['verdict'], s1['episodes'], s2['verdict'], s2['episodes'], s3['verdict']) == (
        'held',
        3,
        'not estimable',
        0,
        'not held',
    )
    assert len(s1['cells']) == 4 and all(c['verdict'] == 'held' for c in s1['cells'])
    assert (
        sampled_hypotheses(_sampled([-0.2, -0.25, -0.3], ['update_failed']))[1]['verdict']
        == 'contradicted'
    )
    # low = 0.2 - 4.30 x 0.1 / sqrt(3) < 0
    assert sampled_hypotheses(_sampled([0.1, 0.2, 0.3]))[0]['verdict'] == 'undecided'
    assert sampled_hypotheses(_sampled([0.2, 0.25]))[0]['verdict'] == 'not estimable'
    eps = _sampled([0.2, 0.25, 0.3])
    # one cell undecided: the whole undecided
    eps[0]['advantages']['official']['on']['per_episode'] = -5.0
    s1 = sampled_hypotheses(eps)[0]
    assert s1['verdict'] == 'undecided' and [c['verdict'] for c in s1['cells']] == [
        'held',
        'held',
        'held',
        'undecided',
    ]
    s3 = sampled_hypotheses(eps)[2]  # -5.0 against 0.5: opposite signs
    assert s3['verdict'] == 'held' and [c['opposite'] for c in s3['cells']] == [[], [], [], [0]]
    zero = _sampled([0.0, 0.0, 0.0])
    zero[0]['advantages']['official']['off']['per_experience'] = 0.0
    zero[0]['advantages']['observed']['off']['per_experience'] = 0.3
    assert sampled_hypotheses(zero)[2]['verdict'] == 'not held'  # 0 is of no sign: not opposite
    assert sampled_hypotheses(_sampled([1.0, -2.0]))[2]['verdict'] == 'not estimable'
    with pytest.raises(ValueError, match='sampled episode 0: no list of behaviours'):
        sampled_hypotheses([{}])


def test_h10_against_a_zero_per_episode_advantage_stays_json(groups):
    by = made(groups)
    by['C4'][0]['advantages']['official']['on']['per_episode'] = 0.0
    h10 = next(h for h in hypotheses(by, groups) if h['id'] == 'H10')
    bad = [c for c in h10['cells'] if not c['met']]
    assert [(c['group'], c['reward'], c['judge'], c['largest_relative']) for c in bad] == [
        ('C4', 'official', 'on', None)
    ]
    json.dumps(h10, allow_nan=False)
