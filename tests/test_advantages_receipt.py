"""The third AgeMem study's receipt and report, checked without the upstream checkout. A receipt
made from episodes that
follow groups.json (every number chosen here, everything else derived by the study's own
`assemble_receipt`) renders and
verifies; an edited README figure, a swapped advantages.png, an edited protocol.md or groups.json, a
verdict its numbers
do not give, an advantage its group's totals do not give, and an edited probe are each refused,
naming the file. The
sampled part's three outcomes (not run, completed, stopped at 45 minutes) render and verify. With an
upstream checkout at
$AGEMEM_SRC, the constructed groups are played and scored for real into a temporary folder, and
verify."""

import json, os, shutil
from pathlib import Path
import pytest

from memagent.audit import AUDITED_REPOSITORY, AUDITED_REVISION, VerificationError, write_receipt
from memagent.advantages.upstream import ADVANTAGE_FILES, EXECUTED
from memagent.advantages.groups import episode_plans, load_groups, probe_decision
import memagent.advantages.receipt as R
from memagent.advantages.receipt import (
    JUDGES,
    REWARDS,
    assemble_receipt,
    grpo_reference,
    prompt_record,
    render_files,
    render_report,
    verify_advantages,
    run_sampled,
)

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / 'reports' / 'agemem_advantages'
SRC = os.environ.get('AGEMEM_SRC')
G = load_groups(REPORT / 'groups.json')
LEVELS = {'b1': 0.62, 'b2': 0.12, 'b3': -0.88, 'b4': 0.60}
SHOWS = {
    'C1': ('call:Retrieve_memory', 'prose:Retrieve_memory'),
    'C2': ('update_ok', 'update_failed'),
    'C3': ('prose:Update_memory', 'update_failed'),
    'C4': ('add_content', 'add_empty'),
    'C5': ('summary_executed', 'prose:Summary_context'),
    'C6': ('retrieval_used', 'retrieval_ignored'),
}
SYSTEM = prompt_record('the system prompt, read from the checkout at run time')
AUDITED = {
    'repository': AUDITED_REPOSITORY,
    'revision': AUDITED_REVISION,
    'obtained_from': f'https://github.com/{AUDITED_REPOSITORY}',
    'files': dict(ADVANTAGE_FILES),
    'executed': list(EXECUTED),
    'read': [f for f in ADVANTAGE_FILES if f not in EXECUTED],
    'checkout_unchanged_after_run': True,
}


def _mid(c):
    return sum(c['interval']) / 2 if 'interval' in c else 0.0002 if c.get('tie') else c['exact']


DELTA = {
    (h['group'], w, j, b): _mid(h[w][b])
    for h in G['hypotheses']['deltas']
    for j in h['judges']
    for w in REWARDS
    for b in LEVELS
}


def _episode(p, g, tot, shows, stage3=None):
    """One scored episode's record: the plan's replies, 1 + 3 + the rest of its experiences, the
    totals `tot`, behaviours `shows`."""
    n = p['experiences']
    exps = (
        [{'stage': 1, 'distractor': None, 'round': 0, 'why': 'memory tool'}]
        + [{'stage': 2, 'distractor': d, 'round': 0, 'why': 'answer'} for d in range(3)]
        + [{'stage': 3, 'distractor': None, 'round': k, 'why': 'answer'} for k in range(n - 4)]
    )
    answer = {'b1': 'Kestrel Bay', 'b2': 'Gull Point', 'b3': None, 'b4': 'Kestrel Bay'}.get(
        p.get('background'), 'x'
    )
    return {
        'group': g,
        'variant': p.get('variant'),
        'background': p.get('background'),
        'task_id': p['task_id'],
        'episode': p['episode'],
        'replies': [
            {**r, 'calls': [], 'prompt_tokens': 2000, 'generated_tokens': 20, 'seconds': 0.0}
            for r in p['replies']
        ],
        'context': [{'role': 'system', 'system_prompt': SYSTEM}],
        'log': [],
        'experiences': exps,
        'finished_at_round': n - 4,
        'found_answer': answer is not None,
        'final_answer': answer,
        'task_score': float(answer == 'Kestrel Bay'),
        'lost': None,
        'window_break': False,
        'behaviours': list(shows),
        'rewards': {
            w: {j: {'total': t, 'breakdown': {'total': t}} for j, t in d.items()}
            for w, d in tot.items()
        },
    }


def _scored(g, eps, lost=None):
    """The group with the advantages upstream's formula gives (`grpo_reference`); a lost group with
    none."""
    if lost:
        for e in eps:
            e['rewards'] = e['advantages'] = None
        eps[0]['lost'] = lost
        return {'group': g, 'task_id': eps[0]['task_id'], 'lost': lost, 'episodes': eps}
    for e in eps:
        e['advantages'] = {w: {} for w in REWARDS}
    for w in REWARDS:
        for j in JUDGES:
            (pe, _), (pp, _) = grpo_reference(
                [e['rewards'][w][j]['total'] for e in eps], [len(e['experiences']) for e in eps]
            )
            for e, a, b in zip(eps, pe, pp):
                e['advantages'][w][j] = {'per_experience': a, 'per_episode': b}
    return {'group': g, 'task_id': eps[0]['task_id'], 'lost': None, 'episodes': eps}


def _constructed(lost=()):
    out = []
    for g, plans in episode_plans(G).items():
        eps = []
        for p in plans:
            v, b = p['variant'], p['background']
            tot = {
                w: {
                    j: LEVELS[b] + 0.075 * (w == 'observed') + (v == 'A') * DELTA[(g, w, j, b)]
                    for j in JUDGES
                }
                for w in REWARDS
            }
            eps.append(
                _episode(
                    p,
                    g,
                    tot,
                    [SHOWS[g][v == 'B']]
                    + ['answered'] * (b != 'b3')
                    + ['correct'] * (b in ('b1', 'b4')),
                )
            )
        out.append(
            _scored(
                g,
                eps,
                'reply 0 (stage 1, round 0): EpisodeError: a call that is not an object'
                if g in lost
                else None,
            )
        )
    return out


def _probe(t_probe, parsable):
    p = sum(parsable) / len(parsable)
    rec = {
        'task_id': '0/row1',
        'episode': 0,
        'replies': [
            {
                'stage': 1,
                'distractor': None,
                'round': 0,
                'text': 'hello',
                'calls': [],
                'prompt_tokens': 2000,
                'generated_tokens': 5,
                'seconds': 1.0,
            }
        ]
        * len(parsable),
        'context': [],
        'log': [],
        'experiences': [],
        'finished_at_round': 0,
        'found_answer': False,
        'final_answer': None,
        'task_score': 0.0,
        'lost': None,
        'window_break': False,
    }
    return {
        'task': '0/row1',
        'episode': 0,
        't_probe': t_probe,
        'replies': len(parsable),
        'parsable': list(parsable),
        'p': p,
        'decision': probe_decision(t_probe, p, len(parsable)),
        'episode_record': rec,
        'policy': {
            'model': {'name': 'smollm2-135m-instruct', 'weights_sha256': '1' * 64},
            'source': {'gguf': 'x.gguf', 'gguf_sha256': '2' * 64},
            'tokenizer': {'all_files_sha256': '3' * 64},
        },
    }


def _sampled_group(row, seed, state='finished'):
    if state != 'finished':
        return {
            'task': f'0/row{row}',
            'row': row,
            'state': state,
            'started_s': 2000.0 if state == 'unfinished' else None,
            'seconds': 800.0 if state == 'unfinished' else None,
        }
    eps = []
    for e in range(8):
        off, obs = 0.1 * ((e * 7 + seed) % 8), 0.1 * ((e * 5 + seed) % 8) - 0.05 * (e % 2)
        p = {
            'task_id': f'0/row{row}',
            'episode': e,
            'experiences': 5 + e % 3,
            'replies': [{'stage': 1, 'distractor': None, 'round': 0, 'text': 'a reply'}],
        }
        shows = (
            ['prose:Retrieve_memory'] * (e % 2 == 0)
            + ['update_failed'] * (e % 3 == 0)
            + ['answered']
        )
        eps.append(
            _episode(
                p,
                None,
                {'official': {j: off for j in JUDGES}, 'observed': {j: obs for j in JUDGES}},
                shows,
            )
        )
    for x in eps:
        del x['group'], x['variant'], x['background']
    return {
        'task': f'0/row{row}',
        'row': row,
        'state': 'finished',
        'started_s': 600.0 * (row - 1),
        'seconds': 600.0,
        **_scored(None, eps),
    }


def _report(tmp_path, name='report', **kw):
    """A report folder: the committed protocol.md and groups.json, the made receipt, its figure and
    README."""
    d = tmp_path / name
    d.mkdir()
    for f in ('protocol.md', 'groups.json'):
        shutil.copy(REPORT / f, d / f)
    rc = assemble_receipt(
        G,
        kw.pop('audited', AUDITED),
        SYSTEM,
        {'all_files_sha256': '0' * 64},
        kw.pop('constructed', None) or _constructed(),
        kw.pop('probe', None),
        kw.pop('sgroups', []),
        kw.pop('asked', True),
        d,
    )
    write_receipt(rc, d / 'receipt.json')
    render_files(rc, d)
    return d, rc


def _fails(d, *needles):
    with pytest.raises(VerificationError) as e:
        verify_advantages(d)
    for n in needles:
        assert n in str(e.value), str(e.value)[-1500:]
    return str(e.value)


@pytest.fixture(scope='module')
def made(tmp_path_factory):
    return _report(tmp_path_factory.mktemp('adv'))


def test_a_made_receipt_renders_and_verifies(made, capsys):
    d, rc = made
    assert (
        rc['status'],
        rc['summary']['held'],
        rc['summary']['cases'],
        rc['summary']['episodes'],
    ) == ('passed', 13, 13, 48)
    assert verify_advantages(d)['status'] == 'verified'
    text = (d / 'README.md').read_text()
    assert text.startswith(
        "# AgeMem, the third study: which behaviours each reward's GRPO advantage reinforces\n"
    )
    assert (
        text.index('## The answer')
        < text.index('## Hypotheses')
        < text.index('## Per behaviour')
        < text.index('## Sampled groups')
    )
    line = next(
        x
        for x in text.splitlines()
        if x.startswith('- Only the observed reward reinforces, judge off: ')
    )
    assert '`summary_executed`' in line  # C5: A's summary, observed only
    line = next(
        x
        for x in text.splitlines()
        if x.startswith('- Only the official reward reinforces, judge off: ')
    )
    assert '`prose:Summary_context`' in line  # C5: B names it, official only
    assert 'Sampled part' not in text and 'Not run: the probe was not run' in text
    from memagent.observed.receipt import audit_cli  # the console script's function

    assert (
        audit_cli(['--study', 'advantages', '--verify', '--report-dir', str(d)]) == 0
        and '"verified"' in capsys.readouterr().out
    )


def test_an_edited_readme_figure_is_refused(made, tmp_path):
    d = shutil.copytree(made[0], tmp_path / 'c')
    text = (d / 'README.md').read_text()
    (d / 'README.md').write_text(
        text.replace('13 of 13 hypotheses held', '12 of 13 hypotheses held', 1)
    )
    _fails(d, 'README.md: not the rendering of the receipt', 'line 3 reads')


def test_a_swapped_figure_is_refused(made, tmp_path, capsys):
    d = shutil.copytree(made[0], tmp_path / 'c')
    (d / 'advantages.png').write_bytes((d / 'advantages.png').read_bytes() + b'\0')
    _fails(d, "advantages.png: the figure's SHA-256")
    from memagent.observed.receipt import audit_cli

    assert (
        audit_cli(['--study', 'advantages', '--verify', '--report-dir', str(d)]) == 1
        and 'advantages.png' in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    'name,edit',
    [
        ('protocol.md', lambda t: t + '\nAn edit after the run.\n'),
        ('groups.json', lambda t: t.replace('Kestrel Bay', 'Kestrel Cove')),
    ],
)
def test_an_edited_input_is_refused(made, tmp_path, name, edit):
    d = shutil.copytree(made[0], tmp_path / 'c')
    (d / name).write_text(edit((d / name).read_text()))
    _fails(d, f'{d / name}', 'SHA-256')


def _tampered(made, tmp_path, edit):
    d = shutil.copytree(made[0], tmp_path / 'c')
    rc = json.loads((d / 'receipt.json').read_text())
    edit(rc)
    write_receipt(rc, d / 'receipt.json')
    return d


def test_a_verdict_its_numbers_do_not_give_is_refused(made, tmp_path):
    d = _tampered(made, tmp_path, lambda rc: rc['hypotheses'][3].update(held=False))
    _fails(
        d, 'receipt.json: hypothesis H3: the receipt says held=False, its numbers give held=True'
    )


def test_a_total_moved_out_of_its_cell_turns_the_verdict_and_the_advantages(made, tmp_path):
    """A reward edited in the receipt: its group's advantages no longer follow from the totals, and
    H5's verdict is not the recorded one."""
    edit = lambda rc: rc['constructed']['groups'][4]['episodes'][5]['rewards']['official'][
        'off'
    ].update(total=0.9)
    _fails(
        _tampered(made, tmp_path, edit),
        'receipt.json: group C5 episode 5: official advantage, judge off',
        'receipt.json: hypothesis H5: the receipt says held=True, its numbers give held=False',
    )


@pytest.mark.parametrize(
    'what,edit,needle',
    [
        (
            'a scripted reply',
            lambda rc: rc['constructed']['groups'][0]['episodes'][0]['replies'][0].update(
                text='edited'
            ),
            'group C1 episode 0: replies',
        ),
        (
            'finished_at_round',
            lambda rc: rc['constructed']['groups'][1]['episodes'][2].update(finished_at_round=3),
            'finished_at_round 3, 1 Stage-3',
        ),
        (
            'a behaviour',
            lambda rc: rc['constructed']['groups'][2]['episodes'][0]['behaviours'].append(
                'delete_ok'
            ),
            'behaviours.constructed',
        ),
        ('the limits', lambda rc: rc.update(limits='A trained policy improved.'), 'limits: stored'),
        (
            'a field no runner writes',
            lambda rc: rc.update(claim='more'),
            'receipt.claim: not a field the runner writes',
        ),
        (
            'the checkout',
            lambda rc: rc['audited'].update(checkout_unchanged_after_run=False),
            'the checkout was not left as found',
        ),
        (
            'the status',
            lambda rc: rc.update(status='not_held'),
            "status: stored 'not_held', recomputed 'passed'",
        ),
    ],
)
def test_an_edited_field_is_refused(made, tmp_path, what, edit, needle):
    _fails(_tampered(made, tmp_path, edit), needle)


def test_a_lost_group_enters_no_advantage_and_turns_what_reads_it(tmp_path):
    d, rc = _report(tmp_path, constructed=_constructed(lost=('C6',)))
    assert rc['status'] == 'group_lost' and rc['summary']['lost_groups'] == ['C6']
    assert {h['id'] for h in rc['hypotheses'] if not h['held']} == {
        'H6',
        'H6j',
        'H7',
        'H8',
        'H9',
        'H10',
    }
    assert not any(r['behaviour'] == 'retrieval_used' for r in rc['behaviours']['constructed'])
    assert verify_advantages(d)['receipt_status'] == 'group_lost'


def test_a_probe_below_the_rule_reports_the_sampled_part_not_run(tmp_path):
    d, rc = _report(tmp_path, probe=_probe(240.0, [False] * 9 + [True]))
    assert (rc['sampled']['state'], rc['probe']['decision']['groups']) == ('not run', 1)
    text = (d / 'README.md').read_text()
    assert '| `0/row1` | 10 | 1 | 0.100 | 240.0 | 1 | p >= 0.20 and N >= 2 | not run |' in text
    assert (
        "Sampled part: **not run**. The probe's rule: p = 0.100 is below 0.20; N = 1 is below 2."
        in text
    )
    assert verify_advantages(d)['sampled'] == 'not run'
    _fails(
        _tampered((d, rc), tmp_path / 'p', lambda r: r['probe'].update(p=0.5)),
        'probe.p (the share of replies with a parsable call)',
    )
    _fails(
        _tampered((d, rc), tmp_path / 'd', lambda r: r['probe']['decision'].update(run=True)),
        "probe.decision (the protocol's rule)",
    )


def test_sampled_groups_are_analysed_when_two_finish(tmp_path):
    groups = [
        _sampled_group(1, 1),
        _sampled_group(2, 4),
        _sampled_group(3, 0, 'unfinished'),
        _sampled_group(4, 0, 'not started'),
    ]
    d, rc = _report(tmp_path, probe=_probe(60.0, [True, False]), sgroups=groups)
    sp = rc['sampled']
    assert (sp['state'], [h['id'] for h in sp['hypotheses']]) == ('completed', ['S1', 'S2', 'S3'])
    assert {r['behaviour'] for r in rc['behaviours']['sampled']} == {
        'prose:Retrieve_memory',
        'update_failed',
        'answered',
    }
    text = (d / 'README.md').read_text()
    assert (
        'Sampled part: **completed**. 2 of 4 groups finished, not lost, within 45 minutes, and '
        'are analysed.' in text
    )
    assert verify_advantages(d)['sampled'] == 'completed'
    d2, rc2 = _report(
        tmp_path, 'one', probe=_probe(60.0, [True, False]), sgroups=groups[:1] + groups[2:]
    )
    assert (
        rc2['sampled']['state'],
        rc2['sampled']['hypotheses'],
        rc2['behaviours']['sampled'],
    ) == ('not completed', None, [])
    assert verify_advantages(d2)['sampled'] == 'not completed'


def test_sampled_groups_stop_45_minutes_after_the_first_starts(monkeypatch):
    """Each group's engine calls take 1000 s on a counting clock: two finish, the third is stopped
    at its next call, the fourth never starts."""
    now = [0.0]

    class Walk:
        def __init__(self, mods, tasks, size, tok):
            self.task = tasks[0]

        def records(self):
            return []

    def run_sync(walk, engine, on_step=None):
        now[0] += 1000.0
        on_step()

    monkeypatch.setattr(R, 'AgeMemWalk', Walk)
    monkeypatch.setattr(R, 'run_sync', run_sync)
    monkeypatch.setattr(
        R,
        'score_group',
        lambda mods, recs, task, tid, system: {'task_id': tid, 'lost': None, 'episodes': []},
    )
    tasks = [{'task_id': f'0/row{i}', 'row': i} for i in range(1, 5)]
    out = run_sampled({}, tasks, None, None, 'system', clock=lambda: now[0])
    assert [(g['state'], g['started_s']) for g in out] == [
        ('finished', 0.0),
        ('finished', 1000.0),
        ('unfinished', 2000.0),
        ('not started', None),
    ]


def test_the_report_renders_from_the_receipt_alone(made):
    """render_report reads nothing but the receipt: the same receipt and figure hash give the same
    bytes."""
    d, rc = made
    from memagent.provenance import sha256_file

    again = json.loads((d / 'receipt.json').read_text())
    assert (
        render_report(again, figure_sha256=sha256_file(d / 'advantages.png'))
        == (d / 'README.md').read_text()
    )


@pytest.mark.skipif(
    not (SRC and Path(SRC).is_dir()),
    reason='AGEMEM_SRC is not set to an upstream AgeMem checkout at the pinned revision',
)
def test_the_constructed_groups_played_on_the_checkout_verify(tmp_path):
    """The real constructed part (no probe) into a temporary folder: every episode scored, the
    receipt rendered and verified."""
    d = tmp_path / 'report'
    d.mkdir()
    for f in ('protocol.md', 'groups.json'):
        shutil.copy(REPORT / f, d / f)
    rc = R.run_advantages(SRC, d, probe=False)
    write_receipt(rc, d / 'receipt.json')
    render_files(rc, d)
    res = verify_advantages(d)
    assert (
        res['status'] == 'verified'
        and res['episodes'] == 48
        and rc['sampled']['state'] == 'not run'
    )
    assert [len(g['episodes']) for g in rc['constructed']['groups']] == [8] * 6 and not rc[
        'summary'
    ]['lost_groups']
