"""Tests of the fuzzed parity and of what the parity verifier accepts: an article-only gold answer
is scored as
Relax scores it, every figure the parity report renders is recomputed (an edited one is refused), a
fork named as
the origin is refused, a faithful receipt of a disagreeing run verifies as `failed`, the committed
fuzz draws
replay from their seed without the upstream code, and the README is the receipt's rendering (an
edited or missing
one is refused)."""

import copy, gzip, hashlib, json, shutil, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memagent.parity import (
    FIXTURES_PATH,
    VerificationError,
    compare,
    get_parity,
    ours,
    verify_receipt,
)
from memagent.reward import boxed_em, score_prediction

REPORT = ROOT / 'reports' / 'parity'
FIXTURES = ROOT / FIXTURES_PATH


def _edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d, indent=1, ensure_ascii=False) + '\n')


def _case(rc, mode, cid):
    return next(c for c in rc['modes'][mode]['cases'] if c['id'] == cid)


@pytest.fixture
def copies(tmp_path):
    """A copy of reports/parity (receipt and, where committed, the fuzz draws) and of the fixtures
    that a test may damage."""
    for p in REPORT.iterdir():
        if p.is_file():
            shutil.copy(p, tmp_path / p.name)
    shutil.copy(FIXTURES, tmp_path / 'fixtures.jsonl')
    return tmp_path / 'receipt.json', tmp_path / 'fixtures.jsonl'


# --- the relax reward on gold answers that normalize to the empty string (Relax: `bool(pred) and
# norm(pred) == norm(gold)`)


def test_article_only_gold_answer_scores_as_relax():
    assert boxed_em(r'\boxed{The}', ['The The']) == 1.0  # Relax's reward_func gives 1.0 here
    assert boxed_em(r'so \boxed{ the }', ['Paris', 'The The']) == 1.0
    assert boxed_em(r'\boxed{!?}', ['.']) == 1.0  # punctuation only: both normalize to ''
    assert boxed_em(r'\boxed{ }', ['The The']) == 0.0  # an empty box never scores
    assert boxed_em('The The', ['The The']) == 0.0  # no box
    assert score_prediction(r'\boxed{The}', ['The The'])['boxed_em'] == 1.0
    assert get_parity('relax').score(r'\boxed{The}', ['The The'])['boxed_em'] == 1.0
    out = ours(
        'relax', {'id': 'x', 'group': 'g', 'response': r'\boxed{The}', 'answers': ['The The']}
    )
    assert out['train_reward']['score'] == 1.0 and out['eval']['boxed_em'] == 1.0


# --- the parity verifier refuses every edited figure the report renders, and a fork as origin


def _refused(receipt, fixtures, edit, match):
    _edit(receipt, edit)
    with pytest.raises(VerificationError, match=match):
        verify_receipt(receipt, fixtures)


@pytest.mark.parametrize(
    'edit, match',
    [
        (
            lambda rc: rc['modes']['official']['aggregate']['checks'][1].__setitem__('ours', 12.5),
            r'official: aggregate\.checks\[1\]\.ours: the receipt records 12\.5',
        ),
        (
            lambda rc: rc['modes']['relax']['aggregate']['checks'][1].__setitem__('agree', False),
            r'relax: aggregate\.checks\[1\]\.agree: the receipt records False',
        ),
        (
            lambda rc: rc['modes']['relax']['summary'].__setitem__('aggregate_agrees', False),
            r'relax: summary\.aggregate_agrees: the receipt records False',
        ),
        (
            lambda rc: rc['modes']['official']['summary'].__setitem__(
                'disagreeing_cases', ['yes_long']
            ),
            r"official: summary\.disagreeing_cases: the receipt records \['yes_long'\]",
        ),
        (
            lambda rc: rc['modes']['official']['summary'].__setitem__('agreed', 1),
            r'official: summary\.agreed: the receipt records 1',
        ),
        (
            lambda rc: _case(rc, 'relax', 'case_upper')['checks'][0].__setitem__('ours', 0.0),
            r"relax: case 'case_upper': checks\[0\]\.ours: the receipt records 0\.0",
        ),
        (
            lambda rc: _case(rc, 'relax', 'case_upper')['checks'][2].__setitem__(
                'upstream', 'LONDON'
            ),
            r"relax: case 'case_upper': checks\[2\]\.upstream: the receipt records 'LONDON'",
        ),
        (
            lambda rc: _case(rc, 'official', 'yes_long')['checks'][0].__setitem__('agree', False),
            r"official: case 'yes_long': checks\[0\]\.agree: the receipt records False",
        ),
        (
            lambda rc: rc.__setitem__('status', 'failed'),
            r"receipt status is 'failed', the recorded data give 'passed'",
        ),
    ],
)
def test_edited_rendered_figure_is_refused(copies, edit, match):
    _refused(*copies, edit, match)


def test_upstream_disagreement_hidden_by_the_checks_is_refused(copies):
    def edit(rc):
        case = _case(rc, 'official', 'whitespace_box')
        case['upstream']['eval']['sub_em'] = 0.0
        next(c for c in case['checks'] if c['field'] == 'eval.sub_em')['upstream'] = (
            0.0  # the display copy follows
        )

    _refused(
        *copies,
        edit,
        r"official: case 'whitespace_box': eval\.sub_em: upstream recorded 0\.0, ours 1\.0, "
        r"the receipt's check says .*'agree': True",
    )


@pytest.mark.parametrize(
    'mode, origin',
    [
        ('official', 'https://github.com/someone/MemAgent'),
        ('official', 'https://github.com/BytedTsinghua-SIA/MemAgent-fork'),
        ('relax', 'https://github.com/someone/Relax'),
    ],
)
def test_fork_origin_is_refused(copies, mode, origin):
    _refused(
        *copies,
        lambda rc: rc['modes'][mode]['upstream'].__setitem__('origin', origin),
        f'{mode}: upstream: origin',
    )


# --- the fuzz section: a faithful record of disagreement verifies as failed; edits are refused; the
# seed replays


@pytest.fixture
def fuzz():
    import memagent.fuzz as fz

    return fz


def _rewrite_fuzz(fz, receipt, lines):
    """Store `lines` as the receipt's fuzz file and make the section and the status what they give
    (a faithful record)."""
    from memagent.parity import receipt_status

    rc = json.loads(receipt.read_text())
    sec = rc['fuzz']
    fz.write_fuzz(sec, lines, receipt.parent)
    sec.update(fz.fuzz_summary(lines))
    sec['disagreements'] = fz.disagreements(lines)
    rc['status'] = receipt_status(rc)
    receipt.write_text(json.dumps(rc, indent=1, ensure_ascii=False) + '\n')
    # and its rendering
    (receipt.parent / 'README.md').write_text(fz.render_readme(rc, receipt.parent))
    return rc


def test_committed_fuzz_replays_from_the_seed(fuzz):
    rc = json.loads((REPORT / 'receipt.json').read_text())
    assert rc['fuzz']['count'] >= 10_000 and rc['fuzz']['grammar'] == fuzz.GRAMMAR_VERSION
    res = fuzz.verify(REPORT, FIXTURES, sample=400)
    assert (
        res['status'] == 'verified'
        and res['fuzz']['replayed'] >= 400
        and res['fuzz']['draws'] == rc['fuzz']['count']
    )
    assert (
        rc['status'] == 'passed'
        and res['receipt_status'] == 'passed'
        and res['fuzz']['disagreements'] == 0
    )


def test_committed_fuzz_has_article_only_gold_answers_that_agree(fuzz):
    from memagent.reward import extract_boxed, normalize_answer

    lines = fuzz.read_fuzz(REPORT / fuzz.FUZZ_FILE)
    hit = [
        ln
        for ln in lines
        if not ln['draw'].get('error')
        and extract_boxed(ln['draw']['response']).strip()
        and any(normalize_answer(a) == '' for a in ln['draw']['answers'])
        and normalize_answer(extract_boxed(ln['draw']['response'])) == ''
    ]
    assert len(hit) >= 50
    # Relax's own outputs
    assert all(ln['upstream']['relax']['train_reward']['score'] == 1.0 for ln in hit)
    assert all(
        c['agree']
        for ln in hit
        for c in compare(ln['upstream']['relax'], ours('relax', ln['draw']))
    )


def test_faithful_failed_receipt_verifies(fuzz, copies):
    receipt, fixtures = copies
    lines = fuzz.read_fuzz(receipt.parent / fuzz.FUZZ_FILE)
    lines[7]['upstream']['relax']['train_reward']['score'] = (
        1 - lines[7]['ours']['relax']['train_reward']['score']
    )
    rc = _rewrite_fuzz(fuzz, receipt, lines)
    assert rc['status'] == 'failed' and len(rc['fuzz']['disagreements']) == 1
    res = fuzz.verify(receipt.parent, fixtures, sample=50)
    assert res['receipt_status'] == 'failed' and res['fuzz']['disagreements'] == 1


@pytest.mark.parametrize(
    'edit, match',
    [
        (
            lambda s: s['modes']['relax'].__setitem__('agreed', s['modes']['relax']['agreed'] - 1),
            'fuzz: modes: the receipt records',
        ),
        (lambda s: s.__setitem__('count', 5), 'fuzz: count: the receipt records 5'),
        (
            lambda s: s['disagreements'].append({'i': 0, 'mode': 'relax'}),
            r'the recorded disagreements \(1\)',
        ),
        (
            lambda s: s.__setitem__('seed', s['seed'] + 1),
            'draw 0: the stored draw is not what seed',
        ),
        (
            lambda s: s.__setitem__('grammar', 'memagent.fuzz.grammar/0'),
            "grammar 'memagent.fuzz.grammar/0'",
        ),
        (lambda s: s.__setitem__('sha256', '0' * 64), 'fuzz.jsonl.gz SHA-256'),
        (
            lambda s: s['upstream']['official'].__setitem__(
                'origin', 'https://github.com/someone/MemAgent'
            ),
            "fuzz: upstream official is not the source",
        ),
    ],
)
def test_edited_fuzz_section_is_refused(fuzz, copies, edit, match):
    receipt, fixtures = copies
    _edit(receipt, lambda rc: edit(rc['fuzz']))
    with pytest.raises(VerificationError, match=match):
        fuzz.verify(receipt.parent, fixtures, sample=50)


def test_hidden_disagreement_in_the_status_is_refused(fuzz, copies):
    receipt, fixtures = copies
    lines = fuzz.read_fuzz(receipt.parent / fuzz.FUZZ_FILE)
    lines[3]['upstream']['official']['train_reward'] = (
        1 - lines[3]['ours']['official']['train_reward']
    )
    _rewrite_fuzz(fuzz, receipt, lines)
    _edit(receipt, lambda rc: rc.__setitem__('status', 'passed'))
    with pytest.raises(
        VerificationError, match="receipt status is 'passed', the recorded data give 'failed'"
    ):
        fuzz.verify(receipt.parent, fixtures, sample=50)


def test_stored_draw_or_our_output_edited_is_refused(fuzz, copies):
    receipt, fixtures = copies
    lines = fuzz.read_fuzz(receipt.parent / fuzz.FUZZ_FILE)
    n = len(lines)
    lines[0]['draw']['answers'] = ['edited']  # draw 0 is always replayed
    lines[n - 1]['ours']['relax']['eval']['f1'] = 0.123  # and so is the last one
    lines[n - 1]['upstream']['relax']['eval']['f1'] = 0.123  # keep it a record without disagreement
    _rewrite_fuzz(fuzz, receipt, lines)
    with pytest.raises(VerificationError, match='draw 0: the stored draw is not what seed') as e:
        fuzz.verify(receipt.parent, fixtures, sample=10)
    assert f"draw {n - 1} (fz{n - 1:05d}): relax: eval.f1: our output is now" in str(e.value)


def test_fuzz_file_bytes_depend_only_on_the_lines(fuzz, tmp_path):
    lines = [{'i': 0, 'draw': fuzz.draw(1, 0), 'upstream': {}, 'ours': {}}]
    a, b = {'file': fuzz.FUZZ_FILE}, {'file': fuzz.FUZZ_FILE}
    fuzz.write_fuzz(a, lines, tmp_path / 'a')
    fuzz.write_fuzz(b, lines, tmp_path / 'b')
    assert (
        a['sha256']
        == b['sha256']
        == hashlib.sha256((tmp_path / 'a' / fuzz.FUZZ_FILE).read_bytes()).hexdigest()
    )
    assert json.loads(gzip.decompress((tmp_path / 'a' / fuzz.FUZZ_FILE).read_bytes()))[
        'draw'
    ] == fuzz.draw(1, 0)


# --- the README is the receipt's rendering: the committed one is reproduced byte for byte, an
# edited or missing one is refused


def test_committed_readme_is_the_rendering_of_the_receipt(fuzz):
    rc = json.loads((REPORT / 'receipt.json').read_text())
    assert (REPORT / 'README.md').read_bytes() == fuzz.render_readme(rc, REPORT).encode()
    assert fuzz.readme_problems(rc, REPORT) == []
    res = fuzz.verify(REPORT, FIXTURES, sample=50)
    assert res['status'] == 'verified' and res['readme'] == 'the rendering of receipt.json'


@pytest.mark.parametrize(
    'edit, line',
    [
        (
            lambda t: t.replace('748 of\n748 checks agreed', '748 of\n750 checks agreed', 1),
            "line 8 reads '750 checks agreed",
        ),
        (
            lambda t: t.replace(
                '| relax | em | 0.481818 | 0.481818 |', '| relax | em | 0.5 | 0.481818 |', 1
            ),
            "reads '| relax | em | 0.5 |",
        ),
        (
            lambda t: t.replace('**Status: passed.**', '**Status: passed (reviewed).**', 1),
            "line 5 reads '**Status: passed (reviewed).**",
        ),
        (
            lambda t: t.replace('`sha256:9d4223ea6696ef38`', '`sha256:0000000000000000`', 1),
            "reads '- [receipt.json](receipt.json) `sha256:0000000000000000`",
        ),
        (lambda t: t + 'Reviewed.\n', "reads 'Reviewed.\\n', the rendering has None"),
        (lambda t: t.rstrip('\n'), 'the rendering has'),
    ],
)
def test_edited_readme_is_refused(fuzz, copies, edit, line):
    receipt, fixtures = copies
    readme = receipt.parent / 'README.md'
    text = readme.read_text()
    assert edit(text) != text
    readme.write_text(edit(text))
    with pytest.raises(
        VerificationError, match='README.md: not the rendering of receipt.json'
    ) as e:
        fuzz.verify(receipt.parent, fixtures, sample=10)
    assert line in str(e.value)
    assert len(e.value.problems) == 1  # the receipt and the draws still verify


def test_missing_readme_is_refused(fuzz, copies):
    receipt, fixtures = copies
    (receipt.parent / 'README.md').unlink()
    with pytest.raises(VerificationError, match=r'README\.md: missing') as e:
        fuzz.verify(receipt.parent, fixtures, sample=10)
    assert e.value.problems == [
        f"{receipt.parent / 'README.md'}: missing (it is the rendering of receipt.json)"
    ]
