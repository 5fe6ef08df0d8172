"""Export cells hold one idea each: no `#| export` cell is over 60 lines, as ruff formats it.

A long cell is split at its top-level statements into consecutive export cells. A long class is laid
out one method per cell with `memagent.patch` (`patch_to`, `patch`); a long function is split into
helpers. A definition that cannot be split without harm is listed in `LONG_DEFINITIONS` with its
reason, and `PENDING` lists the long cells not split yet. Both lists only shrink: an entry whose
cell is gone or is now at most 60 lines fails the test until it is removed."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60

# (notebook, cell id) -> why one definition over 60 lines cannot be split; the list only shrinks
LONG_DEFINITIONS = {}

# (notebook, cell id) -> why a cell over 60 lines is not split yet; the list only shrinks
PENDING = {}


def _export_cells():
    "`{(notebook, cell id): number of lines}` for every export code cell of nbs/*.ipynb."
    out = {}
    for p in sorted((ROOT / 'nbs').glob('*.ipynb')):
        for c in json.loads(p.read_text())['cells']:
            src = ''.join(c['source'])
            if c['cell_type'] == 'code' and src.startswith('#| export'):
                out[(p.relative_to(ROOT).as_posix(), c.get('id'))] = len(src.splitlines())
    return out


def test_no_export_cell_is_over_60_lines():
    assert not set(LONG_DEFINITIONS) & set(PENDING), 'a cell is listed twice'
    cells = _export_cells()
    listed = {**LONG_DEFINITIONS, **PENDING}
    long = [
        f'{nb} cell {cid}: {n} lines'
        for (nb, cid), n in cells.items()
        if n > MAX_LINES and (nb, cid) not in listed
    ]
    stale = [
        f'{nb} cell {cid}: '
        + (
            'no such cell'
            if (nb, cid) not in cells
            else f'{cells[(nb, cid)]} lines, no longer over {MAX_LINES}'
        )
        for nb, cid in listed
        if cells.get((nb, cid), 0) <= MAX_LINES
    ]
    assert not long, (
        f'export cells over {MAX_LINES} lines (split them at top-level statements):\n'
        + '\n'.join(long)
    )
    assert not stale, (
        'listed long cells that are gone or short now (remove them from the list):\n'
        + '\n'.join(stale)
    )
