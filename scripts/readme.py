#!/usr/bin/env python
"""Render README.md from nbs/index.ipynb, reading every figure from the committed report files.

    python scripts/readme.py            # write README.md python scripts/readme.py --check    # exit
    1 if README.md is not the rendering, or quotes an untraced number

The README is the notebook's markdown cells joined by blank lines. `scripts/readme_sources.py`
assigns `readme_sources = {...}` (a dict literal, read with `ast`, never executed here), naming the
report files the figures come from:

    'bench': {'file': 'reports/bench/cpu/bench.json', 'commit': 'bench.provenance.git.commit',
              'dirty': 'bench.provenance.git.dirty'}                   # a JSON report 'train_md':
              {'file': 'reports/train/*/README.md',                    # a markdown report:
              'fields': {'wall_min': r'Wall time: ([0-9.]+) min'}}   #   one regex group per field

`file` is relative to the repository root, inside reports/, and may hold one `*` that must match
exactly one file. `commit` (optional) and `dirty` (optional) name where the report records the git
commit of the run. In the markdown cells:

    {{bench.rollout.speedup:.2f}}   the value at a dotted key path (list indices allowed, -1 for the
    last), formatted with a Python format spec; `:len` gives a list's length, booleans render as
    true/false; a markdown field is `{{train_md.wall_min}}` {{bench}}                       the
    citation of a source: its file, SHA-256 prefix and run commit

Anything missing (file, key, regex match, commit) stops the rendering with the file and key named.
"""

from __future__ import annotations
import argparse, ast, difflib, hashlib, json, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX, SOURCES, README, REPORTS = (
    'nbs/index.ipynb',
    'scripts/readme_sources.py',
    'README.md',
    'reports',
)
PLACEHOLDER = re.compile(r'\{\{\s*([A-Za-z_]\w*)((?:\.[^.:{}\s]+)*)\s*(?::([^{}]*))?\}\}')
TEXT_SUFFIXES = {'.json', '.md', '.csv', '.yaml', '.yml', '.txt', '.ipynb', '.jsonl'}
# Numbers that are names, not measurements: removed before the figure check, each with its reason.
NOT_FIGURES = {
    'Python 3.11': 'the supported Python version',
    'CC BY-SA 4.0': 'the licence of the shipped data',
}


def notebook_parts(nb_path: Path, sources_path: Path | None = None) -> tuple[list[str], dict]:
    """The markdown cells of the index notebook, and the `readme_sources` dict of `sources_path`
    (default: beside it, SOURCES)."""
    nb = json.loads(nb_path.read_text())
    md = [''.join(cell['source']) for cell in nb['cells'] if cell['cell_type'] == 'markdown']
    sources_path = sources_path or nb_path.parent.parent / SOURCES
    found = [
        ast.literal_eval(node.value)
        for node in ast.parse(sources_path.read_text()).body
        if isinstance(node, ast.Assign)
        and [getattr(t, 'id', None) for t in node.targets] == ['readme_sources']
    ]
    if len(found) != 1:
        raise ValueError(
            f"{sources_path}: readme_sources must be assigned exactly once, found {len(found)}"
        )
    return md, found[0]


class Source:
    "One report file: its resolved path, content (parsed JSON or markdown fields) and citation."

    def __init__(self, alias: str, spec: dict, root: Path):
        self.alias, self.spec, self.root = alias, spec, root
        pattern = spec['file']
        if not pattern.startswith(REPORTS + '/'):
            raise ValueError(
                f"readme_sources[{alias!r}]: {pattern} is not under {REPORTS}/; figures come from "
                "reports"
            )
        hits = sorted(root.glob(pattern))
        if len(hits) != 1:
            raise ValueError(
                f"readme_sources[{alias!r}]: {pattern} matches {len(hits)} files "
                f"{[str(h.relative_to(root)) for h in hits]}, expected exactly 1"
            )
        self.path = hits[0]
        self.rel = self.path.relative_to(root).as_posix()
        self.raw = self.path.read_bytes()
        if 'fields' in spec:
            text = self.raw.decode('utf-8')
            self.data = {}
            for name, rx in spec['fields'].items():
                found = re.findall(rx, text, flags=re.M)
                if len(found) != 1 or not isinstance(found[0], str):
                    raise ValueError(
                        f"{self.rel}: field {name!r}: pattern {rx!r} must match once with one "
                        f"group, matched {len(found)} times"
                    )
                self.data[name] = found[0]
        else:
            self.data = json.loads(self.raw)

    def get(self, keys: list[str]):
        "The value at a key path; list components are integers (negative from the end)."
        v = self.data
        for i, k in enumerate(keys):
            where = f"{self.rel}: key {'.'.join(keys[: i + 1])!r}"
            if isinstance(v, dict):
                if k not in v:
                    raise KeyError(f"{where} not found (keys: {sorted(v)})")
                v = v[k]
            elif isinstance(v, list):
                try:
                    v = v[int(k)]
                except (ValueError, IndexError):
                    raise KeyError(f"{where}: not an index of a list of {len(v)}") from None
            else:
                raise KeyError(f"{where}: {type(v).__name__} has no keys")
        if v is None:
            raise ValueError(
                f"{self.rel}: key {'.'.join(keys)!r} is null; a figure must be recorded"
            )
        return v


def format_value(v, spec: str | None, where: str) -> str:
    """A value as README text: `len`, a format spec (strings from markdown become numbers),
    true/false, or str."""
    if spec == 'len':
        if not isinstance(v, list):
            raise ValueError(f"{where}: ':len' needs a list, got {type(v).__name__}")
        return str(len(v))
    if isinstance(v, bool):
        return 'true' if v else 'false'
    if spec:
        if isinstance(v, str) and spec[-1] in 'eEfFgGn%':  # a number read from markdown text
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"{where}: {v!r} is not a number for format {spec!r}") from None
        try:
            return format(v, spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: format {spec!r}: {e}") from None
    if isinstance(v, (dict, list)):
        raise ValueError(f"{where}: is a {type(v).__name__}, not a figure")
    return str(v)


def resolve(sources: dict, ref: str, used: set):
    "The value named by `alias.key.path` (a source's commit or dirty flag)."
    alias, *keys = ref.split('.')
    if alias not in sources:
        raise KeyError(f"{ref!r}: no source {alias!r} in readme_sources")
    used.add(alias)
    return sources[alias].get(keys)


def citation(src: Source, sources: dict, used: set) -> str:
    "`file` (SHA-256 prefix, run commit): where a figure was read from."
    sha = hashlib.sha256(src.raw).hexdigest()[:12]
    if 'commit' not in src.spec:
        return f"[`{src.rel}`]({src.rel}) (SHA-256 `{sha}`; the report records no run commit)"
    ref = src.spec['commit']
    commit = resolve(sources, ref, used)
    if not re.fullmatch(r'[0-9a-f]{40}', str(commit)):
        raise ValueError(f"{src.rel}: commit {ref!r} = {commit!r} is not a 40-hex git commit")
    run = f"run at `{commit[:7]}`"
    if 'dirty' in src.spec:
        dirty = resolve(sources, src.spec['dirty'], used)
        if not isinstance(dirty, bool):
            raise ValueError(f"{src.rel}: dirty {src.spec['dirty']!r} = {dirty!r} is not a boolean")
        if dirty:
            run += ' with uncommitted changes'
    other = sources[ref.split('.')[0]]
    if other is not src:
        run += f", as recorded in `{other.rel}`"
    return f"[`{src.rel}`]({src.rel}) (SHA-256 `{sha}`, {run})"


def render(root: Path = ROOT) -> str:
    "README.md's text: the index notebook's markdown with every placeholder filled from reports/."
    md, specs = notebook_parts(root / INDEX)
    sources = {alias: Source(alias, spec, root) for alias, spec in specs.items()}
    used = set()

    def fill(m):
        alias, path, spec = m.group(1), m.group(2), m.group(3)
        if alias not in sources:
            raise KeyError(
                f"{INDEX}: placeholder {m.group(0)!r}: no source {alias!r} in readme_sources"
            )
        used.add(alias)
        if not path:
            if spec is not None:
                raise ValueError(f"{INDEX}: placeholder {m.group(0)!r}: a citation takes no format")
            return citation(sources[alias], sources, used)
        keys = path[1:].split('.')
        return format_value(
            sources[alias].get(keys), spec, f"{sources[alias].rel}: key {'.'.join(keys)!r}"
        )

    text = '\n\n'.join(PLACEHOLDER.sub(fill, cell) for cell in md) + '\n'
    if '{{' in text:
        raise ValueError(
            f"{INDEX}: a placeholder is malformed near {text[text.index('{{') :][:60]!r}"
        )
    if set(sources) - used:
        raise ValueError(f"{INDEX}: readme_sources {sorted(set(sources) - used)} are never used")
    return text


# --- the figure check: every quoted decimal, percentage and ratio is a number some report file
# holds ---

_FIGURE = re.compile(r'(?<![\w.\-/])[+-]?(\d+(?:\.\d+)?(?:e[+-]?\d+)?)(%|x\b| pp\b)?(?![\w.%]*\d)')
_NUMBER = re.compile(r'[+-]?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?')


def figures(text: str) -> list[str]:
    """The figures `text` quotes: decimals (`0.913`, `2.9e-06`), percentages (`91%`) and ratios
    (`3.27x`)."""
    for phrase in NOT_FIGURES:
        text = text.replace(phrase, '')
    out = []
    for m in _FIGURE.finditer(text):
        num, unit = m.group(1), m.group(2)
        if unit or '.' in num:
            out.append(m.group(0).lstrip('+-').strip())
    return out


def report_numbers(reports: Path) -> list[float]:
    "Every number written in a text file under `reports/`."
    nums = set()
    for p in sorted(reports.rglob('*')):
        if p.is_file() and p.suffix in TEXT_SUFFIXES:
            nums.update(float(s) for s in _NUMBER.findall(p.read_text(errors='replace')))
    return sorted(nums)


def _quoted(fig: str) -> tuple[str, str]:
    "(number text, unit) of a figure."
    m = re.fullmatch(r'(\d+(?:\.\d+)?(?:e[+-]?\d+)?)(%|x| pp)?', fig)
    return m.group(1), m.group(2) or ''


def traced(fig: str, numbers) -> bool:
    """Whether some report number, rounded as the figure is written, gives the figure (a share x 100
    for % and pp)."""
    num, unit = _quoted(fig)
    q = float(num)
    if 'e' in num:
        digits = len(num.split('e')[0].partition('.')[2])
        fmt = lambda r: float(f'{r:.{digits}e}')
    else:
        digits = len(num.partition('.')[2])
        fmt = lambda r: float(f'{r:.{digits}f}')
    scales = (1, 100) if unit in ('%', ' pp') else (1,)
    return any(fmt(abs(r) * s) == q for r in numbers for s in scales)


def untraced(text: str, reports: Path) -> list[str]:
    "The figures of `text` that no number in `reports/` gives."
    numbers = report_numbers(reports)
    return [f for f in figures(text) if not traced(f, numbers)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        '--check', action='store_true', help='compare with README.md instead of writing it'
    )
    args = ap.parse_args(argv)
    text = render(ROOT)
    bad = untraced(text, ROOT / REPORTS)
    if bad:
        print(f"FAIL: {README} would quote figures that no file under {REPORTS}/ holds: {bad}")
        return 1
    if not args.check:
        (ROOT / README).write_text(text)
        print(f"wrote {README} from {INDEX} and {REPORTS}/")
        return 0
    current = (ROOT / README).read_text()
    if current != text:
        sys.stdout.writelines(
            difflib.unified_diff(
                current.splitlines(True), text.splitlines(True), README, 'rendered'
            )
        )
        print(
            f"FAIL: {README} is not the rendering of {INDEX} with {REPORTS}/ (run: python "
            "scripts/readme.py)"
        )
        return 1
    print(f"{README} is the rendering of {INDEX} with {REPORTS}/; every figure is in a report file")
    return 0


if __name__ == '__main__':
    sys.exit(main())
