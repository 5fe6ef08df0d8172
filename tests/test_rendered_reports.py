"""Every committed report that a verifier vouches for is checked as a reader sees it: the README
byte for byte against
its renderer, and every image the README shows against the SHA-256 the README states. One test runs
over every such
report; a new one fails `test_every_verified_report_is_listed` until it is listed here."""

import re, shutil
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _audit(d):
    from memagent.auditreport import verify_receipt

    return verify_receipt(d)


def _observed(d):
    from memagent.observed import verify_observed

    return verify_observed(d)


def _parity(d):
    from memagent.fuzz import verify

    return verify(d, sample=5)


def _loss_parity(d):
    from memagent.lossreceipt import verify

    return verify(d)


def _acceptance(d):
    from memagent.acceptance.report import verify_acceptance

    return verify_acceptance(d)


def _advantages(d):
    from memagent.advantages import verify_advantages

    return verify_advantages(d)


# report folder -> its verifier; the files a receipt-verifier reads are found in the folder itself
VERIFIED = {
    'agemem_audit': _audit,
    'agemem_observed': _observed,
    'agemem_advantages': _advantages,
    'parity': _parity,
    'loss_parity': _loss_parity,
}
VERIFIED.update(
    {
        str(p.parent.relative_to(ROOT / 'reports')): _acceptance
        for p in sorted((ROOT / 'reports' / 'acceptance').glob('*/compare.json'))
    }
)


def test_every_verified_report_is_listed():
    "A folder under reports/ with a receipt.json or an acceptance compare.json has a verifier here."
    found = {
        str(p.parent.relative_to(ROOT / 'reports'))
        for p in (ROOT / 'reports').rglob('receipt.json')
    }
    found |= {
        str(p.parent.relative_to(ROOT / 'reports'))
        for p in (ROOT / 'reports' / 'acceptance').glob('*/compare.json')
    }
    assert found == set(VERIFIED), found ^ set(VERIFIED)


def _copy(name, tmp_path) -> Path:
    d = tmp_path / name.replace('/', '_')
    shutil.copytree(ROOT / 'reports' / name, d, ignore=shutil.ignore_patterns('*.ipynb'))
    return d


def _fails_naming(verify, d, needle):
    with pytest.raises(Exception) as e:
        verify(d)
    # a failed verification, no crash
    assert type(e.value).__name__ in ('VerificationError', 'ReportMismatch'), repr(e.value)
    assert needle in str(e.value), str(e.value)[-600:]


@pytest.mark.parametrize('name', sorted(VERIFIED))
def test_every_verifier_reads_the_readme_and_its_images(name, tmp_path):
    """The committed report verifies; a figure edited in its README, and each image it shows
    swapped, fail naming the file."""
    verify = VERIFIED[name]
    assert verify(ROOT / 'reports' / name)['status'] == 'verified'
    d = _copy(name, tmp_path)
    readme = (d / 'README.md').read_text()
    digit = re.search(r'\d', readme.split('\n', 2)[2])  # the first figure after the title
    at = len('\n'.join(readme.split('\n', 2)[:2])) + 1 + digit.start()
    (d / 'README.md').write_text(readme[:at] + str((int(readme[at]) + 1) % 10) + readme[at + 1 :])
    _fails_naming(verify, d, 'README.md')
    images = sorted(set(re.findall(r'!\[[^\]]*\]\(([^)\s]+\.png)\)', readme)))
    for img in images:
        d = _copy(name, tmp_path / img.replace('/', '_'))
        # another image than the one the README was rendered with
        (d / img).write_bytes((d / img).read_bytes() + b'\0')
        _fails_naming(verify, d, 'README.md' if name.startswith('acceptance') else img)
