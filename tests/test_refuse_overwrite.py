"""Every console tool that takes input files and an output path refuses an output that would replace one of its inputs
(however spelt), naming both, with the refusal exit code 2, and writes nothing: the folder is byte-identical afterwards."""
import json
from pathlib import Path

import pytest

from memagent.acceptance import compare_cli
from memagent.data import convert_cli, haystack_cli
from memagent.evaluate import evaluate_cli


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob('*')) if p.is_file()}


def _runs(d: Path):
    for r in ('cand', 'ref', 'base'):
        (d / r).mkdir(); (d / r / 'summary.json').write_text('{"a": 1}\n'); (d / r / 'records.jsonl').write_text('{}\n')


CASES = [
    ('memagent-convert: output = input', convert_cli, lambda d: [str(d / 'in.jsonl'), str(d / 'in.jsonl')], 'the output'),
    ('memagent-convert: output = input, spelt another way', convert_cli, lambda d: [str(d / 'in.jsonl'), str(d / 'sub' / '..' / 'in.jsonl')], 'the output'),
    ('memagent-convert: manifest = input', convert_cli, lambda d: [str(d / 'in.jsonl'), str(d / 'o.jsonl'), '--manifest', str(d / 'in.jsonl')], 'the manifest'),
    ('memagent-haystack: output = pool', haystack_cli, lambda d: [str(d / 'in.jsonl'), str(d / 'in.jsonl'), '--num-docs', '3'], 'the output'),
    ('memagent-haystack: manifest = questions', haystack_cli,
     lambda d: [str(d / 'pool.jsonl'), str(d / 'o.jsonl'), '--num-docs', '3', '--questions', str(d / 'in.jsonl'), '--manifest', str(d / 'in.jsonl')], 'the manifest'),
    ('memagent-evaluate: --data is the records file of --out', evaluate_cli,
     lambda d: ['--model', 'tiny-qwen3', '--data', str(d / 'records.jsonl'), '--out', str(d)], '--out file records.jsonl'),
    ('memagent-compare: --out is a file of a run it reads', compare_cli,
     lambda d: ['--candidate', str(d / 'cand'), '--reference', str(d / 'ref'), '--base', str(d / 'base'), '--out', str(d / 'ref' / 'summary.json')],
     "the --out"),
]


@pytest.mark.parametrize('cli,args,says', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_output_that_would_replace_an_input_is_refused_and_nothing_is_written(tmp_path, capsys, cli, args, says):
    for f in ('in.jsonl', 'pool.jsonl', 'records.jsonl'): (tmp_path / f).write_text(json.dumps({'id': f}) + '\n')
    (tmp_path / 'sub').mkdir(); _runs(tmp_path)
    before = _tree(tmp_path)
    assert cli(args(tmp_path)) == 2
    err = capsys.readouterr().err
    assert says in err and 'would replace the input' in err, err
    assert _tree(tmp_path) == before
