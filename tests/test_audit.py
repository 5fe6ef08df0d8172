"""Tests of the AgeMem reward audit: the committed receipt verifies, tampering is caught, and (with
an
upstream checkout at $AGEMEM_SRC) a fresh run reproduces the receipt."""

import json, os, re, shutil, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memagent.audit import (
    AUDITED_REPOSITORY,
    AUDITED_REVISION,
    AuditRefused,
    N_CASES,
    REWARD_MODULE,
    VerificationError,
    check_checkout,
    run_audit,
)
from memagent.auditreport import audit_cli, render_report, verify_receipt

# the `memagent-audit` entry point
from memagent.observed.receipt import (
    audit_cli as console_audit_cli,
)

REPORT = ROOT / 'reports' / 'agemem_audit'
FILES = ('fixtures.json', 'protocol.md', 'receipt.json', 'README.md')
SRC = os.environ.get('AGEMEM_SRC')
needs_src = pytest.mark.skipif(
    not (SRC and Path(SRC).is_dir()),
    reason='AGEMEM_SRC is not set to an upstream AgeMem checkout at the pinned revision; '
    'the full run is skipped (verify-mode tests still run)',
)


@pytest.fixture
def copy_dir(tmp_path):
    "A temporary copy of the artefact folder that a test may damage."
    for f in FILES:
        shutil.copy(REPORT / f, tmp_path / f)
    return tmp_path


def _edit_json(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d, indent=1) + '\n')


def test_committed_receipt_verifies():
    res = verify_receipt(REPORT)
    assert res['status'] == 'verified' and res['cases'] == N_CASES and res['checks'] > 0
    assert res['audited'].endswith(AUDITED_REVISION)
    assert audit_cli(['--verify', '--report-dir', str(REPORT)]) == 0


def test_committed_readme_is_the_rendering_of_the_receipt():
    rc = json.loads((REPORT / 'receipt.json').read_text())
    assert render_report(rc).encode() == (REPORT / 'README.md').read_bytes()


def test_edited_readme_fails(copy_dir, capsys):
    """`sed s/464/400/` on the copy's README: the receipt still verifies, the README is not its
    rendering."""
    readme = copy_dir / 'README.md'
    readme.write_text(
        ''.join(
            re.sub('464', '400', line, count=1)
            for line in readme.read_text().splitlines(keepends=True)
        )
    )
    with pytest.raises(
        VerificationError,
        match=re.escape(f'{readme}: not the rendering of the receipt: line 4 reads'),
    ) as e:
        verify_receipt(copy_dir)
    assert "'down before the run (400 of 464 checks" in str(e.value) and 'the rendering has' in str(
        e.value
    )
    assert 're-render it from the receipt' in str(e.value) and len(e.value.problems) == 1
    capsys.readouterr()
    assert console_audit_cli(['--verify', '--report-dir', str(copy_dir)]) == 1
    assert (
        'VERIFY FAILED' in (err := capsys.readouterr().err)
        and 'README.md: not the rendering of the receipt' in err
    )


def test_missing_readme_fails(copy_dir, capsys):
    (copy_dir / 'README.md').unlink()
    with pytest.raises(
        VerificationError,
        match=re.escape(f"{copy_dir / 'README.md'}: missing; re-render it from the receipt"),
    ):
        verify_receipt(copy_dir)
    capsys.readouterr()
    assert console_audit_cli(['--verify', '--report-dir', str(copy_dir)]) == 1
    assert 'README.md: missing' in capsys.readouterr().err


def test_changed_fixture_fails(copy_dir):
    _edit_json(
        copy_dir / 'fixtures.json',
        lambda d: d['cases'][0]['expect']['breakdown'].__setitem__('memory_r_maintenance', 0.0),
    )
    with pytest.raises(VerificationError, match='fixtures.json SHA-256'):
        verify_receipt(copy_dir)
    assert audit_cli(['--verify', '--report-dir', str(copy_dir)]) == 1


def test_changed_protocol_fails(copy_dir):
    p = copy_dir / 'protocol.md'
    p.write_text(p.read_text() + '\nAmended after the run.\n')
    with pytest.raises(VerificationError, match='protocol.md SHA-256'):
        verify_receipt(copy_dir)


def test_changed_output_fails(copy_dir):
    def edit(rc):
        case = next(c for c in rc['cases'] if c['id'] == 'delete_failed')
        case['observed']['breakdown']['memory_r_maintenance'] = 0.0

    _edit_json(copy_dir / 'receipt.json', edit)
    with pytest.raises(VerificationError, match="'delete_failed': breakdown.memory_r_maintenance"):
        verify_receipt(copy_dir)


def test_changed_match_flag_fails(copy_dir):
    _edit_json(
        copy_dir / 'receipt.json',
        lambda rc: rc['cases'][2]['checks'][0].__setitem__('match', False),
    )
    with pytest.raises(VerificationError, match='recorded checks disagree'):
        verify_receipt(copy_dir)


def test_missing_case_fails(copy_dir):
    _edit_json(copy_dir / 'receipt.json', lambda rc: rc['cases'].pop(7))
    with pytest.raises(VerificationError, match='present 0 times') as e:
        verify_receipt(copy_dir)
    assert 'summary' in str(e.value)


def test_duplicated_case_fails(copy_dir):
    _edit_json(copy_dir / 'receipt.json', lambda rc: rc['cases'].append(rc['cases'][0]))
    with pytest.raises(VerificationError, match='present 2 times'):
        verify_receipt(copy_dir)


def test_other_revision_fails(copy_dir):
    _edit_json(
        copy_dir / 'receipt.json', lambda rc: rc['audited'].__setitem__('revision', '0' * 40)
    )
    with pytest.raises(VerificationError, match='not the pinned'):
        verify_receipt(copy_dir)


def test_committed_receipt_records_a_clean_run_from_the_audited_repository():
    rc = json.loads((REPORT / 'receipt.json').read_text())
    assert rc['status'] == 'passed' and rc['audited']['checkout_unchanged_after_run'] is True
    assert (
        rc['audited']['obtained_from'] == f'https://github.com/{AUDITED_REPOSITORY}'
        and rc['audited']['executed'] == REWARD_MODULE
    )


def test_modified_checkout_recorded_in_the_receipt_fails(copy_dir):
    _edit_json(
        copy_dir / 'receipt.json',
        lambda rc: rc['audited'].__setitem__('checkout_unchanged_after_run', False),
    )
    with pytest.raises(VerificationError, match='checkout_unchanged_after_run=False'):
        verify_receipt(copy_dir)
    assert audit_cli(['--verify', '--report-dir', str(copy_dir)]) == 1


def test_receipt_silent_about_the_checkout_fails(copy_dir):
    _edit_json(
        copy_dir / 'receipt.json', lambda rc: rc['audited'].pop('checkout_unchanged_after_run')
    )
    with pytest.raises(VerificationError, match='checkout_unchanged_after_run=None'):
        verify_receipt(copy_dir)


@pytest.mark.parametrize(
    'source',
    [
        'https://github.com/someone-else/AgeMem',
        '/home/me/mirrors/AgeMem',
        'https://gitlab.com/Helicoplacoidea/AgeMem',
        None,
    ],
)
def test_foreign_source_fails(copy_dir, source):
    _edit_json(
        copy_dir / 'receipt.json', lambda rc: rc['audited'].__setitem__('obtained_from', source)
    )
    with pytest.raises(
        VerificationError,
        match=re.escape(
            f'audited copy: origin {source!r} is not https://github.com/{AUDITED_REPOSITORY}'
        ),
    ):
        verify_receipt(copy_dir)
    assert audit_cli(['--verify', '--report-dir', str(copy_dir)]) == 1


def test_failed_run_fails(copy_dir):
    _edit_json(copy_dir / 'receipt.json', lambda rc: rc.__setitem__('status', 'mismatch'))
    with pytest.raises(VerificationError, match="status is 'mismatch'"):
        verify_receipt(copy_dir)


def test_other_executed_file_fails(copy_dir):
    _edit_json(
        copy_dir / 'receipt.json',
        lambda rc: rc['audited'].__setitem__('executed', 'somewhere/else.py'),
    )
    with pytest.raises(VerificationError, match='executed'):
        verify_receipt(copy_dir)


@needs_src
def test_full_run_reproduces_receipt(tmp_path):
    before = check_checkout(SRC)
    fresh = run_audit(SRC, REPORT)
    committed = json.loads((REPORT / 'receipt.json').read_text())
    assert fresh['status'] == 'passed'
    for k in ('cases', 'summary', 'fixtures', 'protocol', 'call_site_weights', 'pinned_official'):
        assert fresh[k] == committed[k], k
    assert fresh['audited']['files'] == committed['audited']['files']
    assert fresh['audited']['checkout_unchanged_after_run'] and check_checkout(SRC) == before
    out = tmp_path / 'receipt.json'
    assert audit_cli(['--source-repo', SRC, '--out', str(out), '--report-dir', str(REPORT)]) == 0
    assert verify_receipt(REPORT, out)['status'] == 'verified'


@needs_src
def test_modified_checkout_is_refused(tmp_path):
    clone = tmp_path / 'AgeMem'
    subprocess.run(['git', 'clone', '-q', '--no-checkout', SRC, str(clone)], check=True)
    subprocess.run(['git', '-C', str(clone), 'checkout', '-q', AUDITED_REVISION], check=True)
    check_checkout(clone)  # the untouched clone is accepted
    p = clone / REWARD_MODULE
    p.write_text(p.read_text() + '\n# local edit\n')
    with pytest.raises(AuditRefused, match='SHA-256'):
        check_checkout(clone)
    assert (
        audit_cli(
            [
                '--source-repo',
                str(clone),
                '--out',
                str(tmp_path / 'r.json'),
                '--report-dir',
                str(REPORT),
            ]
        )
        == 2
    )
    assert not (tmp_path / 'r.json').exists()


def test_run_notebook_verify_mode(tmp_path):
    pm = pytest.importorskip('papermill')
    out = tmp_path / 'out.ipynb'
    pm.execute_notebook(
        str(ROOT / 'nbs' / 'agemem_audit.ipynb'),
        str(out),
        parameters={'mode': 'verify'},
        cwd=str(ROOT),
        progress_bar=False,
        kernel_name='python3',
    )
    nb = json.loads(out.read_text())
    text = ''.join(''.join(o.get('text', '')) for c in nb['cells'] for o in c.get('outputs', []))
    assert '"status": "verified"' in text and AUDITED_REVISION in text


@needs_src
def test_a_run_into_the_report_folder_renders_its_readme(copy_dir):
    """`memagent-audit --source-repo` writing the report folder's receipt writes its README too, so
    the folder verifies as a whole."""
    (copy_dir / 'README.md').unlink()
    assert audit_cli(['--source-repo', SRC, '--report-dir', str(copy_dir)]) == 0
    # same cases, same rendering
    assert (copy_dir / 'README.md').read_bytes() == (REPORT / 'README.md').read_bytes()
    assert verify_receipt(copy_dir)['status'] == 'verified'
