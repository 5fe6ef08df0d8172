"""docs/ holds the seam notebooks rendered with their outputs, each from its notebook's current
source (scripts/docs.py).

Nothing here executes a notebook: the checks compare SHA-256 headers and image links only."""

import importlib.util, shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location('docs_script', ROOT / 'scripts' / 'docs.py')
docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs)


def _copy(tmp_path: Path) -> Path:
    "The files the check reads: the listed notebooks, settings.ini and docs/."
    for nb in docs.NOTEBOOKS:
        (tmp_path / nb).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / nb, tmp_path / nb)
    shutil.copytree(ROOT / 'docs', tmp_path / 'docs')
    return tmp_path


def test_committed_docs_are_fresh(capsys):
    assert docs.main(['--check']) == 0, capsys.readouterr().out


def test_every_page_names_its_notebook_and_links_the_index():
    index = (ROOT / 'docs' / 'README.md').read_text()
    for nb in docs.NOTEBOOKS:
        name = docs.page_name(nb)
        assert f'({name}.md)' in index and f'(../{nb})' in index
        assert docs.HEADER_RX.match((ROOT / 'docs' / f'{name}.md').read_text()).group(1) == nb


def test_edited_notebook_is_stale(tmp_path, capsys):
    root = _copy(tmp_path)
    assert docs.main(['--check', '--root', str(root)]) == 0, capsys.readouterr().out
    capsys.readouterr()
    nb = root / 'nbs' / '10_credit.ipynb'
    nb.write_text(nb.read_text().replace('"cell_type": "markdown"', '"cell_type":  "markdown"', 1))
    assert docs.main(['--check', '--root', str(root)]) == 1
    out = capsys.readouterr().out
    assert 'docs/10_credit.md: stale' in out and 'python scripts/docs.py' in out
    assert out.count('FAIL:') == 1  # only the edited notebook's page


def test_missing_page_and_missing_image_fail(tmp_path, capsys):
    root = _copy(tmp_path)
    (root / 'docs' / '11_loss.md').unlink()
    images = sorted((root / 'docs').glob('*_files/*'))
    assert images, 'no rendered page links an image: the image check would be empty'
    images[0].unlink()
    assert docs.main(['--check', '--root', str(root)]) == 1
    out = capsys.readouterr().out
    assert 'docs/11_loss.md: missing' in out
    assert f'links the image {images[0].parent.name}/{images[0].name}, which is missing' in out


def test_skipped_cells_follow_nbdev_test():
    flags = {'slow', 'gpu'}
    assert [
        docs.skipped(src, flags)
        for src in (
            '#| eval: false\nx = 1',
            '#|eval:false\nx',
            '#| slow\nx',
            '#| export\nx',
            'x = 1  #| slow',
            '#| eval: true\nx',
        )
    ] == [True, True, True, False, False, False]


def test_progress_bars_are_removed():
    text = (
        'start\n\r 10%|#    | 1/10 [00:01<00:09, 1.0it/s]\r100%|#####| 10/10 [00:02<00:00, '
        '5.0it/s]\ndone\n'
    )
    assert docs.clean_text(text) == 'start\ndone\n'
