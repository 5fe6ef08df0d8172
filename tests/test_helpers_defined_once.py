"""Shared helpers have one definition in the package: every module imports it instead of keeping a
copy."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / 'memagent'
HELPERS = ('free_port', 'sha256_file', 'flatten', 'md_table')


def definitions(pkg: Path, names) -> dict:
    """For each name, `file:line` of every `def` of that name in `pkg`'s .py files (module level,
    nested or method)."""
    found = {n: [] for n in names}
    for path in sorted(pkg.rglob('*.py')):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in found:
                found[node.name].append(f'{path.relative_to(pkg.parent)}:{node.lineno}')
    return found


def test_definitions_finds_copies(tmp_path):
    (tmp_path / 'a.py').write_text('def flatten(d): return d\n')
    (tmp_path / 'b.py').write_text(
        'class C:\n    def flatten(self): pass\ndef md_table(rows): pass\n'
    )
    assert definitions(tmp_path, ('flatten', 'md_table', 'free_port')) == {
        'flatten': [f'{tmp_path.name}/a.py:1', f'{tmp_path.name}/b.py:2'],
        'md_table': [f'{tmp_path.name}/b.py:3'],
        'free_port': [],
    }


@pytest.mark.parametrize('name', HELPERS)
def test_helper_defined_once(name):
    where = definitions(PKG, [name])[name]
    assert len(where) == 1, (
        f'{name} must have exactly one def in memagent/, found {len(where)}: {where}'
    )
