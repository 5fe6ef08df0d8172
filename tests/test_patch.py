"""A method added with `memagent.patch` (`patch_to`, `patch`) is compiled outside its class body,
so bare `super()` (no `__class__` cell) and name-mangled `self.__x` do not work in it. Every patched
method of the package is checked here, the ones only a GPU run reaches included."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / 'memagent'


def _patched(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            (isinstance(d, ast.Call) and getattr(d.func, 'id', None) == 'patch_to')
            or getattr(d, 'id', None) == 'patch'
            for d in node.decorator_list
        ):
            yield node


def _problems(fn):
    out = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and getattr(n.func, 'id', None) == 'super' and not n.args:
            out.append(f'{fn.name}, line {n.lineno}: bare super() (write super(Cls, self))')
        if isinstance(n, ast.Attribute) and n.attr.startswith('__') and not n.attr.endswith('__'):
            out.append(f'{fn.name}, line {n.lineno}: name-mangled {n.attr} (use one underscore)')
    return out


def test_a_planted_bare_super_and_mangled_name_are_found():
    src = (
        '@patch_to(A)\ndef f(self):\n    return super().f() + self.__n\n\n'
        '@patch\ndef g(self: A):\n    return super(A, self).g() + self._n + self.__len__()\n'
    )
    found = [p for fn in _patched(ast.parse(src)) for p in _problems(fn)]
    assert sorted(found) == [
        'f, line 3: bare super() (write super(Cls, self))',
        'f, line 3: name-mangled __n (use one underscore)',
    ]


def test_patched_methods_use_two_argument_super_and_no_mangled_names():
    methods, bad = 0, []
    for p in sorted(PKG.rglob('*.py')):
        for fn in _patched(ast.parse(p.read_text())):
            methods += 1
            bad += [f'{p.relative_to(PKG.parent)}: {x}' for x in _problems(fn)]
    assert methods > 100, (
        f'only {methods} patched methods found: is patch_to still how classes are laid out?'
    )
    assert not bad, '\n'.join(bad)
