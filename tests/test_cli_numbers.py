"""Every numeric option of every console tool is held to the range its meaning requires by one
mechanism,
`memagent.config.cli_number(kind)`: an out-of-range, non-finite or malformed number exits 2 while
the arguments are
parsed, naming the option and what it must be, with no traceback and nothing written.

The console scripts are read from settings.ini. Each tool's parsers are the `ArgumentParser`s it
calls `parse_args`/`parse_known_args` on when run in process with `--help` (argparse is patched only
to record them). An option with a bare `type=int` or `type=float` fails
`test_numeric_options_use_cli_number`, and so does a numeric option that `KINDS` does not list: a
new option needs a deliberate range. A tool with no numeric option is declared in `NO_NUMERIC` (and
checked to have none); a tool whose parser is still to be converted is declared in `PENDING`."""

import argparse, configparser, contextlib, importlib, io, os
from fractions import Fraction
from decimal import Decimal
from pathlib import Path
import pytest
from memagent.config import PARAM_KINDS, cli_number

ROOT = Path(__file__).resolve().parents[1]

# the range each numeric option's meaning requires
KINDS = {
    'memagent-convert': {'--limit': 'int>=1'},  # rows written; 0 would write an empty data set
    'memagent-haystack': {
        '--num-docs': 'int>=1',  # documents per haystack
        '--seed': 'int>=0',  # random.Random seed
        '--limit': 'int>=1',
    },  # questions; 0 would write an empty data set
    'memagent-evaluate': {
        '--samples': 'int>=1',
        '--max-items': 'int>=1',  # eval.samples / eval.max_items: Range(1)
        '--batch-size': 'int>=1',  # items per engine batch
        '--base-max-tokens': 'int>=1',
    },  # new tokens of a base-mode answer
    'memagent-compare': {
        '--tolerance-pp': 'finite>=0',  # percentage points; 0: must match exactly
        '--lengths': 'int>=1',  # RULER-HQA lengths (documents), each item
        '--seed': 'int>=0',
    },  # bootstrap seed (numpy default_rng)
    'memagent-doctor': {
        '--world-size': 'int>=1',  # training ranks
        '--ray-timeout': 'finite>0',
    },  # seconds to wait for the Ray cluster
    'memagent-reward-summary': {
        '--window': 'int>=1',  # moving-average window in steps
        '--expected-steps': 'int>=1',
    },  # steps the run must hold
}
NO_NUMERIC = {
    'memagent-prepare': 'paths, a subset of the pinned files (choices) and flags: no number',
    'memagent-audit': (
        'paths and flags in the three studies (--study reward, --study observed, --study '
        'advantages): no number'
    ),
}
# tool -> why its parser still reads a number with a bare type; each entry fails its tool's tests
# until removed
PENDING = {}
# the argv that reaches each parser a tool builds (default: ['--help'])
HELP_ARGVS = {
    'memagent-audit': (
        ['--help'],
        ['--study', 'observed', '--help'],
        ['--study', 'advantages', '--help'],
    )
}
# out-of-range words per kind ('-inf' and '-1' are passed as --opt=WORD, so argparse never takes
# them for an option)
BAD = {
    'int>=1': ('nan', 'inf', '-1', '0', '2.5', 'abc'),
    'int>=0': ('nan', 'inf', '-1', '2.5', 'abc'),
    'finite>0': ('nan', 'inf', '-inf', '-1', '0', 'abc'),
    'finite>=0': ('nan', 'inf', '-inf', '-1', 'abc'),
}
GOOD = {'int>=1': ('1', 1), 'int>=0': ('0', 0), 'finite>0': ('0.5', 0.5), 'finite>=0': ('0', 0.0)}
BARE = (int, float, complex, Fraction, Decimal)
NOT_NUMERIC = (str, Path)  # types an option may have besides cli_number


def console_scripts() -> dict:
    c = configparser.ConfigParser()
    c.read(ROOT / 'settings.ini')
    return dict(s.split('=', 1) for s in c['DEFAULT']['console_scripts'].split())


def _call(target: str, argv):
    "Run a console tool's function in process: (exit code, stderr, stdout)."
    mod, fn = target.split(':')
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = getattr(importlib.import_module(mod), fn)(argv)
    except SystemExit as e:
        rc = e.code
    return rc, err.getvalue(), out.getvalue()


@contextlib.contextmanager
def _recording():
    """The parsers `parse_known_args` (which `parse_args` calls) is called on, in order; argparse
    otherwise unchanged."""
    seen, orig = [], argparse.ArgumentParser.parse_known_args

    def observe(self, *a, **k):
        if all(p is not self for p in seen):
            seen.append(self)
        return orig(self, *a, **k)

    argparse.ArgumentParser.parse_known_args = observe
    try:
        yield seen
    finally:
        argparse.ArgumentParser.parse_known_args = orig


def parsers(tool: str) -> list:
    "`[(argv prefix, parser)]`: every parser the tool builds, each with the words that reach it."
    target, out = console_scripts()[tool], []
    for argv in HELP_ARGVS.get(tool, (['--help'],)):
        with _recording() as seen:
            rc, err, said = _call(target, argv)
        assert rc == 0 and 'Traceback' not in err, (tool, argv, rc, err[-500:])
        assert seen, f'{tool} {argv}: no ArgumentParser was asked to parse'
        out += [(argv[:-1], p) for p in seen]
    return out


def typed_options(tool: str) -> list:
    "`[(prefix, parser, action)]` for every argument of the tool's parsers that has a `type`."
    return [(pre, p, a) for pre, p in parsers(tool) for a in p._actions if a.type is not None]


def _name(a) -> str:
    return '/'.join(a.option_strings) or a.dest


def _placeholders(parser, skip) -> list:
    """Words that satisfy `parser`'s required arguments besides `skip`: a name for a positional, a
    valid value for a required option."""
    pos, opt = [], []
    for a in parser._actions:
        if a is skip or isinstance(a, argparse._HelpAction):
            continue
        if a.choices:
            word = str(list(a.choices)[0])
        elif isinstance(a.type, cli_number):
            word = GOOD[a.type.kind][0]
        else:
            word = f'placeholder-{a.dest}'
        n = a.nargs if isinstance(a.nargs, int) else 1
        if not a.option_strings and a.nargs not in ('?', '*', argparse.REMAINDER):
            pos += [word] * n
        elif a.option_strings and a.required:
            opt += [a.option_strings[0], *[word] * n]
    return pos + opt


def test_every_console_script_is_declared():
    """Covered (a numeric option, each in KINDS) plus declared (no numeric option, or pending) is
    exactly settings.ini's set."""
    scripts = set(console_scripts())
    covered, declared = set(KINDS) - set(PENDING), set(NO_NUMERIC) | set(PENDING)
    assert covered | declared == scripts, scripts ^ (covered | declared)
    assert not set(KINDS) & set(NO_NUMERIC) and set(PENDING) <= set(KINDS)
    assert all(k in BAD and k in GOOD for kinds in KINDS.values() for k in kinds.values())


@pytest.mark.parametrize('tool', sorted(console_scripts()))
def test_numeric_options_use_cli_number(tool):
    """No option has a bare numeric type; the numeric ones are `cli_number` of the kind KINDS gives;
    their defaults are in range."""
    typed = typed_options(tool)
    bare = [_name(a) for _, _, a in typed if a.type in BARE]
    other = [
        (_name(a), a.type)
        for _, _, a in typed
        if a.type not in BARE and not isinstance(a.type, cli_number) and a.type not in NOT_NUMERIC
    ]
    assert not other, (
        f'{tool}: options with a type this test does not know; a numeric one must use cli_number: '
        f'{other}'
    )
    if tool in PENDING:
        assert bare, (
            f'{tool} has no bare numeric option left: remove it from PENDING ({PENDING[tool]})'
        )
        assert {_name(a) for _, _, a in typed} == set(KINDS[tool]), (
            tool,
            [_name(a) for _, _, a in typed],
        )
        return
    assert not bare, f'{tool}: bare type=int/float for {bare}; use memagent.config.cli_number(kind)'
    found = {_name(a): a.type.kind for _, _, a in typed if isinstance(a.type, cli_number)}
    assert found == KINDS.get(tool, {}), (
        tool,
        found,
        'see NO_NUMERIC' if tool in NO_NUMERIC else 'see KINDS',
    )
    for a in (a for _, _, a in typed if isinstance(a.type, cli_number)):
        assert a.option_strings, (
            f'{tool}: numeric positional {a.dest}: make it an option or extend this test'
        )
        if a.default is not None:
            assert PARAM_KINDS[a.type.kind][1](a.default), (tool, _name(a), a.default)


@pytest.mark.parametrize('tool', sorted(set(KINDS) - set(PENDING)))
def test_out_of_range_numbers_exit_2_naming_the_option(tool, tmp_path, monkeypatch):
    """Each bad word for each numeric option, through the real command: exit 2, the option and its
    range named, no traceback, nothing written."""
    target, checked = console_scripts()[tool], []
    for pre, parser, a in (t for t in typed_options(tool) if t[2].type not in NOT_NUMERIC):
        assert isinstance(a.type, cli_number), (
            f'{tool} {_name(a)}: type {a.type!r}, not cli_number '
            '(test_numeric_options_use_cli_number)'
        )
        opt, (good, value) = a.option_strings[0], GOOD[a.type.kind]
        base = _placeholders(parser, a)
        # the rest of argv is valid
        assert getattr(parser.parse_args([*base, f'{opt}={good}']), a.dest) in (value, [value]), (
            tool,
            opt,
        )
        for word in BAD[a.type.kind]:
            cwd = tmp_path / f'{opt.strip("-")}_{len(checked)}'
            cwd.mkdir()
            monkeypatch.chdir(cwd)
            rc, err, out = _call(target, [*pre, *base, f'{opt}={word}'])
            checked.append((opt, word))
            assert rc == 2, (tool, opt, word, rc, err[-500:])
            assert f'argument {_name(a)}: {word!r} is not {PARAM_KINDS[a.type.kind][0]}' in err, (
                tool,
                opt,
                word,
                err[-500:],
            )
            assert 'Traceback' not in err + out, (tool, opt, word, (err + out)[-500:])
            assert not os.listdir(cwd), (tool, opt, word, os.listdir(cwd))
    assert {o for o, _ in checked} == set(KINDS[tool]), (tool, checked)
