"""Per-sample records that are well hashed but malformed (a field missing, a count that is NaN or a
string, a line that is
not an object, text that cannot be encoded) are refused by `memagent-compare` with exit code 2,
naming the file, the line
and the field, and nothing is written; before, they crashed it with a traceback and exit 1 (the "not
passed" code)."""

import json, math
from pathlib import Path

import pytest

from memagent.acceptance import compare_cli
from memagent.evaluate import RECORDS_FILE, SUMMARY_FILE
from memagent.provenance import sha256_file, sha256_text
from memagent.testing import synthetic_run


@pytest.fixture
def trio(tmp_path):
    return {
        role: Path(
            synthetic_run(
                tmp_path / role,
                n,
                info={'model': {'name': role, 'weights_sha256': sha256_text(role)}},
            )
        ).parent
        for role, n in zip(('candidate', 'reference', 'base'), (520, 500, 400))
    }


def _break(run: Path, line: int, edit):
    """Edit record `line` (1-based) of `run` and record the file's new SHA-256 in its summary, as a
    run that wrote it would."""
    lines = (run / RECORDS_FILE).read_text(encoding='utf-8').splitlines()
    lines[line - 1] = edit(json.loads(lines[line - 1]))
    (run / RECORDS_FILE).write_text('\n'.join(lines) + '\n', encoding='utf-8')
    s = json.loads((run / SUMMARY_FILE).read_text())
    s['records']['sha256'] = sha256_file(run / RECORDS_FILE)
    (run / SUMMARY_FILE).write_text(json.dumps(s))


def _without(k):
    return lambda r: json.dumps({x: v for x, v in r.items() if x != k})


MALFORMED = [
    ('no id', _without('id'), 'id: missing'),
    ('no sample', _without('sample'), 'sample: missing'),
    (
        'num_chunks NaN',
        lambda r: json.dumps({**r, 'num_chunks': math.nan}),
        'num_chunks: nan is not a whole number',
    ),
    (
        'num_chunks a string',
        lambda r: json.dumps({**r, 'num_chunks': '3'}),
        "num_chunks: '3' is not a whole number",
    ),
    ('a list', lambda r: json.dumps([r]), 'a JSON list, not an object'),
    ('not JSON', lambda r: '{"id": ', 'not valid JSON'),
    ('a lone surrogate', lambda r: json.dumps({**r, 'response': 'a \ud800 b'}), 'response: '),
]


@pytest.mark.parametrize('edit,says', [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_records_are_refused_naming_file_line_and_field(
    trio, tmp_path, capsys, edit, says
):
    _break(trio['candidate'], 3, edit)
    out = tmp_path / 'compare.json'
    code = compare_cli(
        [
            '--candidate',
            str(trio['candidate']),
            '--reference',
            str(trio['reference']),
            '--base',
            str(trio['base']),
            '--out',
            str(out),
            '--no-hotpotqa',
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{trio['candidate'] / RECORDS_FILE}: line 3:" in err and says in err, err
    assert not out.exists()


def test_the_gate_lists_malformed_records_as_a_failed_check(trio):
    """The library gate (what the acceptance notebook renders) keeps going: the malformed run is a
    failed, named `records` check."""
    from memagent.acceptance import compare

    _break(trio['candidate'], 3, _without('sample'))
    rep = compare(
        trio['candidate'], trio['reference'], trio['base'], require_hotpotqa=False, n_boot=50
    )
    bad = [c for c in rep['checks'] if c.get('malformed')]
    assert (
        not rep['passed'] and len(bad) == 1 and bad[0]['name'] == 'records' and not bad[0]['passed']
    )
    assert (
        f"{trio['candidate'] / RECORDS_FILE}: line 3: malformed record: sample: missing"
        in bad[0]['reason']
    )
