#!/usr/bin/env python
"""Render the seam notebooks with their outputs into docs/ (markdown that the repository's web view
shows).

    python scripts/docs.py                       # execute each notebook in NOTEBOOKS, write docs/
    python scripts/docs.py nbs/13_trainer.ipynb  # re-render only the named notebooks; keep the
    other pages python scripts/docs.py --check               # no execution: exit 1 if a page is
    missing or stale

The notebooks are committed without outputs, so a reader on the web never sees an example's value or
figure. Each notebook runs top to bottom with nbclient, from nbs/ (as nbdev_test runs it), skipping
the cells nbdev_test skips (`#| eval: false`, the flags of settings.ini's `tst_flags`,
`nbdev_export(`); nbconvert's MarkdownExporter writes docs/<name>.md with its images in
docs/<name>_files/. Each page opens with a header naming its notebook and the SHA-256 of the
notebook file's bytes: `--check` compares that with the notebook as it is now (and that every image
a page links exists, and that docs/README.md is the index this script writes). Pages are written to
a staging folder and replace docs/ only when every notebook rendered, so a failure leaves docs/ as
it was.
"""

from __future__ import annotations
import argparse, configparser, hashlib, json, re, shutil, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = [
    'nbs/00_tour.ipynb',
    'nbs/04_chunking.ipynb',
    'nbs/09_rollout.ipynb',
    'nbs/10_credit.ipynb',
    'nbs/11_loss.ipynb',
    'nbs/13_trainer.ipynb',
]
DOCS, INDEX = 'docs', 'README.md'
CELL_TIMEOUT = 1800  # seconds one cell may run
HEADER = (
    '> Rendered with its outputs from [`{nb}`](../{nb}) (SHA-256 `{sha}`) by `python '
    'scripts/docs.py`; do not edit: change the notebook and run `python scripts/docs.py`.\n\n'
)
HEADER_RX = re.compile(
    r'\A> Rendered with its outputs from \[`([^`]+)`\]\([^)]*\) \(SHA-256 `([0-9a-f]{64})`\)'
)
IMAGE_RX = re.compile(r'!\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+"[^"]*")?\)|<img\s[^>]*src="([^"]+)"')
ANSI_RX = re.compile(r'\x1b\[[0-9;?]*[A-Za-z]')
# a tqdm bar: '40%|####  | 2/5 [00:01<...'
TQDM_RX = re.compile(r'\d+%\|.*\|\s*\d+/\d+|\|\s*\d+/\d+ \[\d')
WIDGET = 'application/vnd.jupyter.widget-view+json'
# the random uuid of a pandas Styler table's ids
STYLER_RX = re.compile(r'(?<![\w])T_([0-9a-f]{5})(?![0-9a-f])')
# warnings that name this machine's paths and say nothing about the example (the line after is the
# warning's source)
NOISE_RX = re.compile(r'TqdmWarning: IProgress not found')


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def page_name(nb: str) -> str:
    return Path(nb).stem


def title(nb_path: Path) -> str:
    "The notebook's first markdown heading (its stem when it has none)."
    for cell in json.loads(nb_path.read_text())['cells']:
        if cell['cell_type'] == 'markdown':
            m = re.search(r'^#+\s+(.+?)\s*$', ''.join(cell['source']), flags=re.M)
            if m:
                return m.group(1)
    return nb_path.stem


def index_text(root: Path) -> str:
    "docs/README.md: the rendered notebooks, each with a link to its page and its source."
    rows = '\n'.join(
        f"| [{page_name(nb)}]({page_name(nb)}.md) | {title(root / nb).replace('|', '&#124;')} | "
        f"[`{nb}`](../{nb}) |"
        for nb in NOTEBOOKS
    )
    return (
        "# The worked examples, rendered with their outputs\n\nThe notebooks under `nbs/` are "
        "committed without outputs. The pages here are the seam notebooks run top to bottom "
        "(from `nbs/`, skipping the cells `nbdev_test` skips) and rendered as markdown with "
        "their printed values and figures, by `python scripts/docs.py`. Each page records the "
        "SHA-256 of the notebook it was rendered from; `python scripts/docs.py --check` (a CI "
        "step) fails when a notebook has changed since its page was rendered.\n\n| page | "
        f"notebook | source |\n|---|---|---|\n{rows}\n"
    )


# --- execution ---


def skip_flags(root: Path) -> set[str]:
    "The flags whose cells nbdev_test skips (settings.ini `tst_flags`)."
    cfg = configparser.ConfigParser()
    cfg.read(root / 'settings.ini')
    return set(cfg['DEFAULT'].get('tst_flags', '').split())


def skipped(source: str, flags: set[str]) -> bool:
    """Whether nbdev_test skips a code cell: `#| eval: false`, a `tst_flags` flag, or a call of
    nbdev_export."""
    if 'nbdev_export' + '(' in source:
        return True
    for line in source.splitlines():
        s = line.strip()
        if not s:
            continue
        if not s.startswith('#|'):
            break  # directives lead the cell
        body = s[2:].strip()
        if re.match(r'eval\s*:\s*false\b', body, flags=re.I):
            return True
        key = body.split()[0] if body else ''
        if key in flags:
            return True
    return False


def clean_text(text: str) -> str:
    "A stream's text without ANSI colours, carriage-return overwrites or tqdm progress bars."
    lines, drop_next = [], False
    for line in ANSI_RX.sub('', text).split('\n'):
        line = line.split('\r')[-1] if '\r' in line.rstrip('\r') else line.rstrip('\r')
        if drop_next and line.startswith(' '):
            drop_next = False
            continue
        drop_next = bool(NOISE_RX.search(line))
        if drop_next or TQDM_RX.search(line):
            continue
        lines.append(line)
    return '\n'.join(lines)


def clean_outputs(nb) -> None:
    """Drop the execution noise that varies run to run: progress bars, widget views, colour codes,
    Styler uuids."""
    for ci, cell in enumerate(nb.cells):
        if cell.cell_type != 'code':
            continue
        kept = []
        for out in cell.get('outputs', []):
            if out.output_type == 'stream':
                out.text = clean_text(out.text)
                if not out.text.strip():
                    continue
            elif out.output_type in ('display_data', 'execute_result'):
                out.data.pop(WIDGET, None)
                if 'text/html' in out.data:
                    for k, uid in enumerate(
                        dict.fromkeys(STYLER_RX.findall(out.data['text/html']))
                    ):
                        out.data['text/html'] = re.sub(
                            rf'(?<![\w])T_{uid}(?![0-9a-f])',
                            f'T_cell{ci}_{k}',
                            out.data['text/html'],
                        )
                plain = out.data.get('text/plain', '')
                if set(out.data) <= {'text/plain'} and (not plain.strip() or TQDM_RX.search(plain)):
                    continue
            elif out.output_type == 'error':
                out.traceback = [ANSI_RX.sub('', t) for t in out.traceback]
            kept.append(out)
        cell.outputs = kept


def render(root: Path, nb_rel: str, out_dir: Path) -> None:
    "Execute one notebook from nbs/ and write `<name>.md` and `<name>_files/` into out_dir."
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import MarkdownExporter

    nb_path, name = root / nb_rel, page_name(nb_rel)
    digest = sha256(nb_path)
    nb = nbformat.reads(nb_path.read_bytes().decode('utf-8'), as_version=4)
    flags, tag = skip_flags(root), 'docs-skip-execution'
    for cell in nb.cells:
        if cell.cell_type == 'code' and skipped(cell.source, flags):
            cell.metadata.setdefault('tags', []).append(tag)
    NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name='python3',
        skip_cells_with_tag=tag,
        allow_errors=False,
        resources={'metadata': {'path': str(nb_path.parent)}},
    ).execute()
    for cell in nb.cells:
        tags = cell.metadata.get('tags', [])
        if tag in tags:
            tags.remove(tag)
            if not tags:
                del cell.metadata['tags']
    clean_outputs(nb)
    body, resources = MarkdownExporter().from_notebook_node(
        nb, resources={'output_files_dir': f'{name}_files', 'unique_key': name}
    )
    (out_dir / f'{name}.md').write_text(HEADER.format(nb=nb_rel, sha=digest) + body.lstrip('\n'))
    for rel, data in sorted(resources.get('outputs', {}).items()):
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / rel).write_bytes(data)


def build(root: Path, only: list[str]) -> None:
    """Render the notebooks (all, or `only` with the other pages copied from docs/) and swap docs/
    in at the end."""
    docs = root / DOCS
    stage = Path(tempfile.mkdtemp(prefix='.docs-staging-', dir=root))
    try:
        for nb in NOTEBOOKS:
            name = page_name(nb)
            if only and nb not in only and (docs / f'{name}.md').is_file():
                shutil.copy2(docs / f'{name}.md', stage / f'{name}.md')
                if (docs / f'{name}_files').is_dir():
                    shutil.copytree(docs / f'{name}_files', stage / f'{name}_files')
                print(f"kept {DOCS}/{name}.md")
                continue
            print(f"rendering {nb} ...", flush=True)
            render(root, nb, stage)
            print(f"rendered {nb} -> {DOCS}/{name}.md", flush=True)
        (stage / INDEX).write_text(index_text(root))
        old = root / f'.docs-old-{stage.name}'
        if docs.exists():
            docs.rename(old)
        stage.rename(docs)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# --- the freshness check (no execution) ---


def problems(root: Path) -> list[str]:
    "Every missing or stale page, missing image and stale index, one line each."
    docs, out = root / DOCS, []
    for nb in NOTEBOOKS:
        page = docs / f'{page_name(nb)}.md'
        rel = page.relative_to(root).as_posix()
        if not (root / nb).is_file():
            out.append(f"{nb}: the notebook is missing (NOTEBOOKS in scripts/docs.py lists it)")
            continue
        if not page.is_file():
            out.append(f"{rel}: missing (the rendering of {nb})")
            continue
        text = page.read_text()
        m = HEADER_RX.match(text)
        if not m or m.group(1) != nb:
            out.append(f"{rel}: no header naming {nb} and its SHA-256")
            continue
        if m.group(2) != sha256(root / nb):
            out.append(
                f"{rel}: stale, rendered from {nb} at SHA-256 {m.group(2)[:12]}, which is now "
                f"{sha256(root / nb)[:12]}"
            )
        for link in IMAGE_RX.finditer(text):
            target = link.group(1) or link.group(2)
            if re.match(r'[a-z]+:', target):
                continue
            if not (page.parent / target).is_file():
                out.append(f"{rel}: links the image {target}, which is missing")
    idx = docs / INDEX
    if not idx.is_file() or idx.read_text() != index_text(root):
        out.append(
            f"{DOCS}/{INDEX}: "
            f"{'missing' if not idx.is_file() else 'not the index this script writes'}"
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        'notebooks',
        nargs='*',
        help='render only these (paths as in NOTEBOOKS); the other pages are kept',
    )
    ap.add_argument(
        '--check', action='store_true', help='execute nothing: check that every page is fresh'
    )
    ap.add_argument(
        '--root', type=Path, default=ROOT, help='the repository root (default: this checkout)'
    )
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if args.check:
        bad = problems(root)
        for line in bad:
            print(f"FAIL: {line}")
        if bad:
            print(f"run: python scripts/docs.py  (and commit {DOCS}/)")
            return 1
        print(f"{DOCS}/ holds a fresh rendering of each of the {len(NOTEBOOKS)} notebooks")
        return 0
    unknown = [nb for nb in args.notebooks if nb not in NOTEBOOKS]
    if unknown:
        ap.error(f"not in NOTEBOOKS: {unknown}")
    build(root, args.notebooks)
    print(f"wrote {DOCS}/ ({len(NOTEBOOKS)} pages and {DOCS}/{INDEX})")
    return 0


if __name__ == '__main__':
    sys.exit(main())
