"""The AgeMem receipt verifier recomputes every figure the reports display from the receipt's own
cases, and the
origin rule shared by the audit and parity verifiers accepts the pinned GitHub URL or the declared
rebuild only."""

import copy, json, shutil, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memagent.audit import (
    AUDITED_PINS,
    AUDITED_REPOSITORY,
    AUDITED_REVISION,
    REBUILD_ORIGIN,
    VerificationError,
    audited_upstream,
    origin_problems,
)
from memagent.auditreport import audit_cli, verify_receipt
from memagent.parity import RELAX_FILES as RELAX_PINS, RELAX_REPOSITORY

REPORT = ROOT / 'reports' / 'agemem_audit'
PARITY = json.loads((ROOT / 'reports' / 'parity' / 'receipt.json').read_text())


def _tampered(tmp_path, edit) -> Path:
    for f in ('fixtures.json', 'protocol.md', 'receipt.json'):
        shutil.copy(REPORT / f, tmp_path / f)
    rc = json.loads((tmp_path / 'receipt.json').read_text())
    edit(rc)
    (tmp_path / 'receipt.json').write_text(json.dumps(rc, indent=1) + '\n')
    return tmp_path


def _set(path, value):
    def edit(rc):
        *head, last = path.split('.')
        d = rc
        for k in head:
            d = d[int(k)] if isinstance(d, list) else d[k]
        d[last] = value

    return edit


def test_committed_receipt_verifies_with_its_figures():
    res = verify_receipt(REPORT)
    rc = json.loads((REPORT / 'receipt.json').read_text())
    assert res['status'] == 'verified' and (res['cases'], res['checks'], res['matched']) == (
        16,
        464,
        464,
    )
    assert (
        rc['summary']['matched'],
        rc['summary']['checks'],
        rc['summary']['cases_with_judge'],
    ) == (464, 464, 2)


# each field a report displays: the README's "464 of 464 checks over 16 cases", "14 ... 2 with a
# stub judge", the repository README's status / cases / matched / checks row, the weights and the
# official revision it names
DISPLAYED = [
    ('summary.matched', 400, 'summary.matched: stored 400, recomputed 464'),
    ('summary.checks', 465, 'summary.checks: stored 465, recomputed 464'),
    ('summary.cases', 15, 'summary.cases: stored 15, recomputed 16'),
    ('summary.cases_with_judge', 3, 'summary.cases_with_judge: stored 3, recomputed 2'),
    ('summary.mismatched', 1, 'summary.mismatched: stored 1, recomputed 0'),
    (
        'summary.mismatched_cases',
        ['judge_one'],
        "summary.mismatched_cases: stored ['judge_one'], recomputed []",
    ),
    ('summary.matched', True, 'summary.matched: stored True, recomputed 464'),
    ('status', 'mismatch', "status: stored 'mismatch', recomputed 'passed'"),
    ('call_site_weights.task_completion_weight', 1 / 3, 'call_site_weights: stored'),
    ('pinned_official.revision', 'f' * 40, 'pinned_official: stored'),
    (
        'cases.14.judge',
        {'reply': '1'},
        "case 'judge_zero': judge: stored {'reply': '1'}, recomputed {'reply': '0'}",
    ),
    (
        'cases.0.group',
        'delete',
        "case 'update_succeeded': group: stored 'delete', recomputed 'update'",
    ),
    (
        'cases.0.checks.4.match',
        False,
        "case 'update_succeeded': recorded checks disagree with a fresh comparison",
    ),
]


@pytest.mark.parametrize(
    'path,value,message', DISPLAYED, ids=[f'{p}={v!r}' for p, v, _ in DISPLAYED]
)
def test_tampered_displayed_figure_is_refused(tmp_path, path, value, message):
    d = _tampered(tmp_path, _set(path, value))
    with pytest.raises(VerificationError) as e:
        verify_receipt(d)
    assert message in str(e.value)
    assert audit_cli(['--verify', '--report-dir', str(d)]) == 1


def test_summary_with_an_extra_field_is_refused(tmp_path):
    with pytest.raises(
        VerificationError, match="summary.success_rate: stored 1.0, recomputed '<missing>'"
    ):
        verify_receipt(_tampered(tmp_path, _set('summary.success_rate', 1.0)))


def test_fork_origin_is_refused():
    up = audited_upstream(json.loads((REPORT / 'receipt.json').read_text())['audited'])
    assert origin_problems(up, AUDITED_REPOSITORY, AUDITED_REVISION, AUDITED_PINS) == []
    for url in (
        'https://github.com/someone/AgeMem',
        f'https://github.com/{AUDITED_REPOSITORY}-fork',
        f'git@github.com:{AUDITED_REPOSITORY}.git',
        f'https://gitlab.com/{AUDITED_REPOSITORY}',
        '/srv/AgeMem',
        None,
    ):
        assert origin_problems(
            dict(up, origin=url), AUDITED_REPOSITORY, AUDITED_REVISION, AUDITED_PINS
        ) == [f'origin {url!r} is not https://github.com/{AUDITED_REPOSITORY}'], url
    for url in (
        f'https://github.com/{AUDITED_REPOSITORY}.git',
        f'https://github.com/{AUDITED_REPOSITORY}/',
    ):
        assert (
            origin_problems(
                dict(up, origin=url), AUDITED_REPOSITORY, AUDITED_REVISION, AUDITED_PINS
            )
            == []
        ), url
    official = PARITY['modes']['official']['upstream']
    pins = {rel: (f['commit'], f['sha256']) for rel, f in official['files'].items()}
    assert origin_problems(official, official['repository'], official['revision'], pins) == []
    fork = dict(official, origin='https://github.com/someone/MemAgent')
    assert origin_problems(fork, official['repository'], official['revision'], pins) == [
        "origin 'https://github.com/someone/MemAgent' is not "
        f"https://github.com/{official['repository']}"
    ]


def test_fork_origin_in_the_receipt_is_refused(tmp_path):
    with pytest.raises(
        VerificationError, match="audited copy: origin 'https://github.com/someone/AgeMem'"
    ):
        verify_receipt(
            _tampered(tmp_path, _set('audited.obtained_from', 'https://github.com/someone/AgeMem'))
        )


def test_declared_rebuild_passes():
    relax = PARITY['modes']['relax']['upstream']
    assert relax['origin'] == REBUILD_ORIGIN
    assert origin_problems(relax, RELAX_REPOSITORY, None, RELAX_PINS) == []


def test_rebuild_with_one_wrong_sha_is_refused():
    relax = copy.deepcopy(PARITY['modes']['relax']['upstream'])
    relax['files']['examples/mem_agent/metrics.py']['sha256'] = '0' * 64
    assert origin_problems(relax, RELAX_REPOSITORY, None, RELAX_PINS) == [
        f"examples/mem_agent/metrics.py: SHA-256 {'0' * 64!r} is not the pinned "
        f"{RELAX_PINS['examples/mem_agent/metrics.py'][1]!r}"
    ]


def test_rebuild_departures_each_named():
    relax = PARITY['modes']['relax']['upstream']

    def probs(**kw):
        return origin_problems({**copy.deepcopy(relax), **kw}, RELAX_REPOSITORY, None, RELAX_PINS)

    assert probs(origin=f'https://github.com/{RELAX_REPOSITORY}') == [
        f"origin 'https://github.com/{RELAX_REPOSITORY}' is not the declared rebuild "
        f"{REBUILD_ORIGIN!r}"
    ]
    assert probs(revision='1' * 40) == [f"revision {'1' * 40!r} is not the pinned None"]
    files = copy.deepcopy(relax['files'])
    files.pop('examples/mem_agent/prompts.py')
    files['examples/mem_agent/extra.py'] = {'commit': '1' * 40, 'sha256': '2' * 64}
    files['examples/mem_agent/reward.py']['commit'] = '3' * 40
    assert probs(files=files) == [
        f"examples/mem_agent/reward.py: commit {'3' * 40!r} is not the pinned "
        f"{RELAX_PINS['examples/mem_agent/reward.py'][0]!r}",
        'examples/mem_agent/prompts.py: missing from files',
        'examples/mem_agent/extra.py: in files but not pinned',
    ]
    # a rebuild is not accepted where a checkout at a revision is pinned, nor a checkout where a
    # rebuild is
    assert probs() == [] and origin_problems(relax, RELAX_REPOSITORY, '1' * 40, RELAX_PINS)[:2] == [
        f"revision None is not the pinned {'1' * 40!r}",
        f"origin {REBUILD_ORIGIN!r} is not https://github.com/{RELAX_REPOSITORY}",
    ]


def _report_numbers(text: str) -> list[str]:
    "Every decimal figure with 4 or more places in a markdown text."
    import re

    return re.findall(r'(?<![\w.])\d+\.\d{4,}(?![\w.])', text)


def test_report_readme_figures_are_the_receipts():
    """The committed AgeMem report states its headline counts, case table and totals as the receipt
    holds them."""
    import re
    from memagent.auditreport import summary_table

    rc = json.loads((REPORT / 'receipt.json').read_text())
    readme = (REPORT / 'README.md').read_text()
    s = rc['summary']
    m = re.search(r'\((\d+) of (\d+) checks over (\d+) cases\)', readme)
    assert m and tuple(map(int, m.groups())) == (s['matched'], s['checks'], s['cases']), (
        m and m.groups()
    )
    m = re.search(r'(\d+) run without a judge,\s+(\d+) with', readme)
    assert m and tuple(map(int, m.groups())) == (
        s['cases'] - s['cases_with_judge'],
        s['cases_with_judge'],
    )
    assert summary_table(rc) in readme, 'the case table in README.md is not summary_table(receipt)'
    totals = {f"{c['observed']['breakdown']['total']:.6f}".rstrip('0') for c in rc['cases']}
    stray = [
        x
        for x in _report_numbers(readme)
        if len(x.split('.')[1]) == 6 and x.rstrip('0') not in totals
    ]
    assert not stray, f'totals in README.md that no receipt case holds: {stray}'


# ---- what cannot be recomputed is pinned or held to the runner's shape; an unknown field or a
# wrong shape is refused ----

UNRECOMPUTABLE = [
    (
        'meaning',
        lambda rc: rc.update(meaning='passed = the reward is correct'),
        "meaning: stored 'passed = the reward is correct'",
    ),
    (
        'added claim',
        lambda rc: rc.update(reviewed_by='an independent auditor'),
        'receipt.reviewed_by: not a field the runner writes',
    ),
    (
        'environment emptied',
        lambda rc: rc.update(environment={}),
        'environment {} is not what the runner writes',
    ),
    (
        'environment extra field',
        lambda rc: rc['environment'].update(gpu='H200'),
        'is not what the runner writes',
    ),
    (
        'audited extra field',
        lambda rc: rc['audited'].update(reviewed=True),
        'audited.reviewed: not a field the runner writes',
    ),
    (
        'case extra field',
        lambda rc: rc['cases'][0].update(note='fine'),
        "case 'update_succeeded'.note: not a field the runner writes",
    ),
    (
        'fixtures path',
        lambda rc: rc['fixtures'].update(path='other.json'),
        "fixtures: stored {'path': 'other.json'",
    ),
    (
        'provenance dirty flipped',
        lambda rc: rc['provenance']['git'].update(dirty=not rc['provenance']['git']['dirty']),
        'provenance.git: dirty=True disagrees with the changed files it lists',
    ),
    ('provenance removed', lambda rc: rc.pop('provenance'), 'receipt.provenance: missing'),
    (
        'provenance claim added',
        lambda rc: rc['provenance'].update(reviewed=True),
        'provenance.reviewed: not a field provenance() writes',
    ),
]


@pytest.mark.parametrize(
    'edit,message', [u[1:] for u in UNRECOMPUTABLE], ids=[u[0] for u in UNRECOMPUTABLE]
)
def test_an_unrecomputable_field_edited_is_refused(tmp_path, edit, message):
    with pytest.raises(VerificationError) as e:
        verify_receipt(_tampered(tmp_path, edit))
    assert message in str(e.value)


def test_fixtures_edited_with_the_receipts_hash_of_them_are_refused(tmp_path):
    """An expectation changed in fixtures.json and the receipt's hash updated to match: the hash
    pinned in the code still refuses it."""
    from memagent.provenance import sha256_file

    d = _tampered(tmp_path, lambda rc: None)
    fx = json.loads((d / 'fixtures.json').read_text())
    fx['cases'][0]['note'] += ' (edited)'
    (d / 'fixtures.json').write_text(json.dumps(fx, indent=1) + '\n')
    rc = json.loads((d / 'receipt.json').read_text())
    rc['fixtures']['sha256'] = sha256_file(d / 'fixtures.json')
    (d / 'receipt.json').write_text(json.dumps(rc, indent=1) + '\n')
    with pytest.raises(VerificationError) as e:
        verify_receipt(d)
    assert 'fixtures.json SHA-256' in str(
        e.value
    ) and 'is not the committed one pinned in memagent.audit' in str(e.value)


# the checks
WRONG_SHAPES = [
    ('a list', lambda rc: [rc], 'a JSON list, not the object a receipt is'),
    ('cases an object', lambda rc: {**rc, 'cases': {'a': 1}}, "cases: {'a': 1}, not a list"),
    ('audited a list', lambda rc: {**rc, 'audited': []}, 'audited: list [], not an object'),
    (
        'summary a string',
        lambda rc: {**rc, 'summary': 'all good'},
        "summary: 'all good', not an object",
    ),
    (
        'observed a list',
        lambda rc: {**rc, 'cases': [{**rc['cases'][0], 'observed': []}, *rc['cases'][1:]]},
        "case 'update_succeeded': observed [] and checks",
    ),
    (
        'checks a number',
        lambda rc: {**rc, 'cases': [{**rc['cases'][0], 'checks': 3}, *rc['cases'][1:]]},
        "case 'update_succeeded': observed {",
    ),
    (
        'a value no runner writes',
        lambda rc: {
            **rc,
            'cases': [{**rc['cases'][0], 'observed': {'memory_stats': 7}}, *rc['cases'][1:]],
        },
        "memory_stats: recorded 7",
    ),
    (
        'files a number',
        lambda rc: {**rc, 'audited': {**rc['audited'], 'files': 5}},
        'audited copy: files is int, not an object',
    ),
    (
        'an id that is a list',
        lambda rc: {
            **rc,
            'cases': [{**rc['cases'][0], 'id': ['x']}, *rc['cases'][1:]],
        },  # the net under
        "the receipt has the wrong shape somewhere its checks above did not name (TypeError: "
        "unhashable type: 'list')",
    ),
]


@pytest.mark.parametrize(
    'make,message', [w[1:] for w in WRONG_SHAPES], ids=[w[0] for w in WRONG_SHAPES]
)
def test_a_receipt_of_the_wrong_shape_fails_verification_with_a_reason(
    tmp_path, make, message, capsys
):
    """The verifier and `memagent-audit --verify` name the reason (exit 1, 'VERIFY FAILED'; a file
    that is no receipt: exit 2, 'REFUSED'); no traceback escapes."""
    d = _tampered(tmp_path, lambda rc: None)
    bad = make(json.loads((d / 'receipt.json').read_text()))
    (d / 'receipt.json').write_text(json.dumps(bad))
    with pytest.raises(VerificationError) as e:
        verify_receipt(d)
    assert message in str(e.value)
    # not a receipt at all: bad input
    code, said = (1, 'VERIFY FAILED') if isinstance(bad, dict) else (2, 'REFUSED')
    assert (
        audit_cli(['--verify', '--report-dir', str(d)]) == code and said in capsys.readouterr().err
    )
