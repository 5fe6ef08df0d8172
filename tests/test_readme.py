"""README.md is the rendering of nbs/index.ipynb with its figures read from reports/
(scripts/readme.py)."""

import importlib.util, json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location('readme_script', ROOT / 'scripts' / 'readme.py')
readme = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme)


def test_readme_is_the_rendering():
    assert (ROOT / 'README.md').read_text() == readme.render(ROOT), (
        'README.md is stale: run python scripts/readme.py and commit README.md'
    )


def test_readme_figures_are_in_reports():
    text = (ROOT / 'README.md').read_text()
    assert readme.figures(text), 'the README quotes no figure at all: the check would be empty'
    assert readme.untraced(text, ROOT / 'reports') == []


def test_made_up_figures_are_flagged(tmp_path):
    # reports that exist
    (tmp_path / 'run.json').write_text('{"r2": 0.99995, "speedup": 3.2670, "fill": 0.9132}')
    made_up = (
        'linear (R^2 0.9998), 7.77x faster, 63.817% of the budget, within 1.23e-04, +31.729 pp'
    )
    assert readme.untraced(made_up, tmp_path) == [
        '0.9998',
        '7.77x',
        '63.817%',
        '1.23e-04',
        '31.729 pp',
    ]
    assert readme.untraced('R^2 0.99995, 3.27x faster, 91% of the budget', tmp_path) == []


def test_figures_rounding_rules():
    nums = [0.9999519713388632, 3.267030001905026, 0.9132265, 2.86102294921875e-06, 40.625]
    assert [
        readme.traced(f, nums) for f in ('0.99995', '1.0000', '0.9998', '3.27x', '3.3x', '3.26x')
    ] == [True, True, False, True, True, False]
    assert [
        readme.traced(f, nums)
        for f in ('91%', '91.3%', '92%', '2.9e-06', '2.8e-06', '40.6 pp', '40.7')
    ] == [True, True, False, True, False, True, False]


def test_names_are_not_figures():
    text = (
        'Python 3.11; CC BY-SA 4.0; `qwen3-0.6b-pilot`; GRPO 8 x 8; TP 2 / DP 4; commit '
        '`1e9959f6`, torch 2.13.0; 24a4cf2; step_000002; R^2 0.5'
    )
    assert readme.figures(text) == ['0.5']


def _repo(tmp_path, md: str, sources: dict, files: dict) -> Path:
    """A minimal repository: nbs/index.ipynb with one markdown cell, scripts/readme_sources.py, and
    the report files."""
    for rel, content in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(content if isinstance(content, str) else json.dumps(content))
    cells = [{'cell_type': 'markdown', 'metadata': {}, 'source': md}]
    (tmp_path / 'scripts').mkdir(exist_ok=True)
    (tmp_path / 'scripts' / 'readme_sources.py').write_text(f'readme_sources = {sources!r}\n')
    (tmp_path / 'nbs').mkdir(exist_ok=True)
    (tmp_path / 'nbs' / 'index.ipynb').write_text(
        json.dumps({'cells': cells, 'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5})
    )
    return tmp_path


RUN = {'speed': 3.14159, 'rows': [1, 2, 3], 'ok': True, 'git': {'commit': 'a' * 40, 'dirty': False}}


def test_render_fills_formats_and_cites(tmp_path):
    md = (
        'speed {{r.speed:.2f}}x, {{r.rows:len}} rows, last {{r.rows.-1}}, ok {{r.ok}}, '
        'wall {{m.minutes}} min ({{m.minutes:.0f}}); {{r}}; {{m}}'
    )
    src = {
        'r': {'file': 'reports/x/run.json', 'commit': 'r.git.commit', 'dirty': 'r.git.dirty'},
        'm': {
            'file': 'reports/x/README.md',
            'commit': 'r.git.commit',
            'fields': {'minutes': r'^Wall: ([0-9.]+) min'},
        },
    }
    root = _repo(
        tmp_path,
        md,
        src,
        {'reports/x/run.json': RUN, 'reports/x/README.md': 'title\nWall: 19.3 min\n'},
    )
    text = readme.render(root)
    assert text.startswith(
        'speed 3.14x, 3 rows, last 3, ok true, wall 19.3 min (19); '
        '[`reports/x/run.json`](reports/x/run.json) (SHA-256 '
    )
    assert (
        ', run at `aaaaaaa`)' in text
        and ', run at `aaaaaaa`, as recorded in `reports/x/run.json`)' in text
    )
    assert readme.untraced(text, root / 'reports') == []


@pytest.mark.parametrize(
    'md, sources, message',
    [
        (
            '{{r.speeed}}',
            {'r': {'file': 'reports/x/run.json'}},
            "reports/x/run.json: key 'speeed' not found",
        ),
        (
            '{{r.rows.5}}',
            {'r': {'file': 'reports/x/run.json'}},
            "key 'rows.5': not an index of a list of 3",
        ),
        ('{{q.speed}}', {'r': {'file': 'reports/x/run.json'}}, "no source 'q'"),
        ('{{r.speed}}', {'r': {'file': 'reports/*/run.json'}}, 'matches 2 files'),
        ('{{r.speed}}', {'r': {'file': 'data/run.json'}}, 'is not under reports/'),
        (
            '{{r.speed}}',
            {'r': {'file': 'reports/x/run.json'}, 'u': {'file': 'reports/y/run.json'}},
            "['u'] are never used",
        ),
        (
            '{{m.minutes}}',
            {'m': {'file': 'reports/x/README.md', 'fields': {'minutes': r'Wall: (\d+) h'}}},
            'must match once',
        ),
        (
            '{{r}}',
            {'r': {'file': 'reports/x/run.json', 'commit': 'r.speed'}},
            'is not a 40-hex git commit',
        ),
        ('{{r.git}}', {'r': {'file': 'reports/x/run.json'}}, 'is a dict, not a figure'),
    ],
)
def test_render_errors_name_the_cause(tmp_path, md, sources, message):
    root = _repo(
        tmp_path,
        md,
        sources,
        {
            'reports/x/run.json': RUN,
            'reports/y/run.json': RUN,
            'reports/x/README.md': 'Wall: 19.3 min\n',
        },
    )
    with pytest.raises(
        (KeyError, ValueError),
    ) as e:
        readme.render(root)
    assert message in str(e.value)
