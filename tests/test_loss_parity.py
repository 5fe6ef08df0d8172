"""The loss parity receipt against verl: the committed receipt verifies without the checkout,
tampering is refused, a
checkout at another commit or with an edited file is refused before anything is written, the
differences it uses are
the ones the loss notebook lists, and (with $VERL_SRC a checkout at the pinned commit) a fresh run
reproduces it."""

import gzip, json, os, re, shutil, subprocess
from pathlib import Path
import pytest
from memagent.lossparity import (
    DIFFERENCES,
    FAMILIES,
    MIN_SEEDS,
    VERL_CONFIG_FIELDS,
    VERL_FILES,
    VERL_REVISION,
    CORE_FILE,
    LossParityRefused,
    VerificationError,
    draw_policy_loss,
    verl_actor_config,
)
from memagent.lossreceipt import CASES_FILE, REPORT_DIR, read_cases, run_loss_parity, verify
from memagent.provenance import sha256_file

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / REPORT_DIR
VERL_SRC = os.environ.get('VERL_SRC')
needs_src = pytest.mark.skipif(
    not (VERL_SRC and Path(VERL_SRC).is_dir()),
    reason=(
        'VERL_SRC is not set to a checkout of volcengine/verl at the pinned commit; the fresh run '
        'is skipped (the committed receipt is still verified without it)'
    ),
)


@pytest.fixture
def copy(tmp_path):
    "A copy of the committed report folder that a test may damage."
    d = tmp_path / 'loss_parity'
    shutil.copytree(REPORT, d)
    return d


def _edit(d, fn):
    rc = json.loads((d / 'receipt.json').read_text())
    fn(rc)
    (d / 'receipt.json').write_text(json.dumps(rc, indent=1, ensure_ascii=False) + '\n')


def test_committed_receipt_verifies_without_the_checkout():
    res = verify(REPORT)
    assert (
        res['status'] == 'verified'
        and res['receipt_status'] == 'passed'
        and res['verl'].endswith(VERL_REVISION)
    )
    for f in FAMILIES:
        s = res['families'][f]
        assert (
            s['cases'] >= 2 * MIN_SEEDS
            and s['checks'] == s['agreed']
            and s['undocumented_differences'] == 0
        ), (f, s)
    rc = json.loads((REPORT / 'receipt.json').read_text())
    assert rc['provenance']['git']['dirty'] is False and re.fullmatch(
        r'[0-9a-f]{40}', rc['provenance']['git']['commit']
    )


def test_an_edited_figure_is_refused(copy):
    _edit(
        copy,
        lambda rc: rc['families']['kl'].__setitem__('agreed', rc['families']['kl']['agreed'] - 1),
    )
    with pytest.raises(
        VerificationError,
        match=r"families\.kl\.agreed: the receipt records \d+, its cases give \d+",
    ):
        verify(copy)


def test_an_edited_readme_is_refused(copy):
    text = (copy / 'README.md').read_text()
    (copy / 'README.md').write_text(text.replace('**Status: passed.**', '**Status: passed!**', 1))
    with pytest.raises(
        VerificationError, match='README.md is not the rendering of receipt.json: line 3'
    ):
        verify(copy)


@pytest.mark.parametrize('where', ['revision', 'file hash', 'origin'])
def test_a_changed_pin_is_refused(copy, where):
    def fn(rc):
        up = rc['upstream']
        if where == 'revision':
            up['revision'] = '0' * 40
        elif where == 'file hash':
            up['files'][CORE_FILE]['sha256'] = 'f' * 64
        else:
            up['origin'] = 'https://github.com/someone/verl'

    _edit(copy, fn)
    with pytest.raises(
        VerificationError,
        match={
            'revision': "revision '0000",
            'file hash': f'{CORE_FILE}: SHA-256',
            'origin': "origin 'https://github.com/someone/verl'",
        }[where],
    ):
        verify(copy)


def test_an_edited_verl_output_is_refused(copy):
    """One recorded verl value changed (and the file re-hashed into the receipt): the recomputed
    checks disagree with the receipt's figures."""
    lines = read_cases(copy / CASES_FILE)
    i = next(i for i, l in enumerate(lines) if l['family'] == 'tis' and l['upstream']['weights'])
    lines[i]['upstream']['weights'][0] += 0.5
    with gzip.open(copy / CASES_FILE, 'wt') as f:
        for l in lines:
            f.write(json.dumps(l) + '\n')
    with pytest.raises(VerificationError, match=f'{CASES_FILE}: SHA-256'):
        verify(copy)
    _edit(copy, lambda rc: rc['fuzz'].__setitem__('cases_sha256', sha256_file(copy / CASES_FILE)))
    with pytest.raises(
        VerificationError,
        match=r"families\.tis\.undocumented_differences: the receipt records \[\], its cases give",
    ):
        verify(copy)


def test_the_differences_are_the_ones_the_loss_notebook_lists():
    """Each documented difference is a row of nbs/11_loss.ipynb's table, word for word, and the
    receipt records the same."""
    text = ''.join(
        ''.join(c['source'])
        for c in json.loads((ROOT / 'nbs' / '11_loss.ipynb').read_text())['cells']
    )
    for k, (kit, compared) in DIFFERENCES.items():
        assert f'| {k} | {kit} | {compared} |' in text, k
    rc = json.loads((REPORT / 'receipt.json').read_text())
    assert list(rc['differences']) == list(DIFFERENCES)


def test_verl_config_holds_only_the_listed_fields():
    for agg, n in (('token_mean', 3), ('trajectory', 5)):
        d = dict(draw_policy_loss(1), agg=agg)
        cfg = verl_actor_config(d, n)
        assert set(cfg) == set(VERL_CONFIG_FIELDS)
        assert cfg.global_batch_info == ({} if agg == 'token_mean' else {'global_batch_size': n})


def _fake_checkout(d: Path):
    "A git checkout at another commit holding the three paths with other text."
    g = lambda *a: subprocess.run(['git', '-C', str(d), *a], check=True, capture_output=True)
    g('init', '-q')
    for rel in VERL_FILES:
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text('# not verl\n')
    g('add', '.')
    g('-c', 'user.email=t@t', '-c', 'user.name=t', 'commit', '-qm', 'x')


def test_run_notebook_refuses_another_checkout_before_writing(tmp_path):
    """mode='run' against a checkout at another commit with other files: refused in the checks,
    naming each file and both hashes; nothing written."""
    from memagent.testing import run_notebook_cells

    src, out = tmp_path / 'verl', tmp_path / 'out'
    src.mkdir()
    _fake_checkout(src)
    _, err = run_notebook_cells(
        ROOT / 'nbs' / 'loss_parity.ipynb',
        {'mode': 'run', 'verl_dir': str(src), 'report_dir': str(out)},
        1,
    )
    assert isinstance(err, LossParityRefused), err
    for rel, (_, pinned) in VERL_FILES.items():
        assert f'{rel}: SHA-256 {sha256_file(src / rel)} != pinned {pinned}' in str(err)
    assert f'pinned revision is {VERL_REVISION}' in str(err) and not out.exists()


def test_run_notebook_verify_mode_checks_the_committed_report():
    from memagent.testing import run_notebook_cells

    ns, err = run_notebook_cells(ROOT / 'nbs' / 'loss_parity.ipynb', {}, 2)
    assert err is None, err
    assert ns['result']['status'] == 'verified' and ns['receipt']['status'] == 'passed'


@needs_src
def test_a_fresh_run_reproduces_the_receipt():
    rc = json.loads((REPORT / 'receipt.json').read_text())
    fresh, lines = run_loss_parity(VERL_SRC, rc['fuzz']['seeds'])
    assert fresh['status'] == rc['status'] == 'passed'
    assert fresh['families'] == rc['families'] and fresh['upstream'] == rc['upstream']
    assert json.loads(json.dumps(lines)) == read_cases(REPORT / CASES_FILE)
