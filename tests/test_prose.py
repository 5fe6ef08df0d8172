"""The seam notebooks read in short sentences.

A newcomer reads the seam notebooks in order (chunking, rollout, credit, loss, trainer, train).
`sentences` measures a notebook's markdown prose: code spans and blocks, tables, headings, link
targets and math are stripped, the rest is split into sentences, and each sentence's words are
counted."""

import json, re
from pathlib import Path

NBS = Path(__file__).resolve().parent.parent / 'nbs'
SEAM = ['04_chunking', '09_rollout', '10_credit', '11_loss', '13_trainer', 'train']
MEAN_MAX, LONGEST_MAX = 20, 45

_ABBREV = re.compile(r'(?<![\w.])(e\.g|i\.e|vs|cf|et al|Dr|approx|resp|Fig|Eq)\.')
_ITEM = re.compile(r'^\s*(?:[-*+]|\d+[.)])\s+')


def _strip(md):
    "Markdown prose without code blocks, tables, headings, html, math, code spans and link targets."
    md = re.sub(r'```.*?```', ' ', md, flags=re.S)
    md = re.sub(r'<[^>]+>', ' ', md)
    md = re.sub(r'\$\$.*?\$\$', ' ', md, flags=re.S)
    lines = []
    for l in md.split('\n'):
        s = l.strip()
        if (
            s.startswith('|')
            or s.startswith('#')
            or s.startswith('>')
            and s.lstrip('> ').startswith('|')
        ):
            continue
        lines.append(l)
    md = '\n'.join(lines)
    md = re.sub(r'\$[^$\n]+\$', ' X ', md)  # inline math counts as one word
    md = re.sub(r'`[^`\n]+`', ' C ', md)  # a code span counts as one word
    md = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', md)  # keep link text, drop the target
    md = re.sub(r'\[([^\]]*)\]\[[^\]]*\]', r'\1', md)
    md = re.sub(r'https?://\S+', ' U ', md)
    return md


def _split(text):
    "Sentences of one paragraph or list item."
    prot = _ABBREV.sub(lambda m: m.group(0).replace('.', '\0'), text)
    prot = re.sub(r'(?<=\d)\.(?=\d)', '\0', prot)  # decimals
    prot = re.sub(r'(?<=\w)\.(?=\w)', '\0', prot)  # x.y identifiers
    parts = re.split(r'(?<=[.?!])["\')\]*_]*\s+(?=["(*_]*[A-Z`0-9])', prot)
    return [' '.join(p.replace('\0', '.').split()) for p in parts if p.strip()]


def sentences(md):
    "Sentences of markdown `md`, split on sentence ends, paragraphs and list-item boundaries."
    blocks, cur = [], []
    for l in _strip(md).split('\n'):
        if not l.strip() or _ITEM.match(l):
            if cur:
                blocks.append(' '.join(cur))
            cur = [_ITEM.sub('', l)] if l.strip() else []
        else:
            cur.append(l.strip())
    if cur:
        blocks.append(' '.join(cur))
    out = []
    for b in blocks:
        for s in _split(b):
            if re.search(r'[A-Za-z]', s):
                out.append(s)
    return out


def words(s):
    return len([w for w in s.split() if re.search(r'\w', w)])


def prose(nb):
    "Sentences of every markdown cell of notebook `nb` (a name in nbs/ or a path)."
    p = Path(nb) if str(nb).endswith('.ipynb') else NBS / f'{nb}.ipynb'
    cells = json.loads(p.read_text())['cells']
    return [
        s for c in cells if c['cell_type'] == 'markdown' for s in sentences(''.join(c['source']))
    ]


def measure(nb):
    "(mean words per sentence, longest sentence's words, sentences) of notebook `nb`."
    ss = prose(nb)
    n = [words(s) for s in ss]
    return sum(n) / len(n), max(n), ss


def test_splitter():
    ss = sentences(
        "One `a.b` call, e.g. 2.5 times (Liu et al. 2025). Two!\n\n- item one\n- item two. "
        "Three\n\n| a | b |\n# Head\n"
        "See [the doc](http://x.y/z.html). `f` runs $a.b$ once. It is special. The end."
    )
    assert ss == [
        'One C call, e.g. 2.5 times (Liu et al. 2025).',
        'Two!',
        'item one',
        'item two.',
        'Three',
        'See the doc.',
        'C runs X once.',
        'It is special.',
        'The end.',
    ], ss


def test_seam_notebooks_read_in_short_sentences():
    bad = []
    for nb in SEAM:
        mean, longest, ss = measure(nb)
        long = [s for s in ss if words(s) > LONGEST_MAX]
        if mean > MEAN_MAX or long:
            worst = sorted(ss, key=words, reverse=True)[:5]
            bad.append(
                f'{nb}: mean {mean:.1f} words per sentence, longest {longest}\n'
                + '\n'.join(f'  [{words(s)}] {s}' for s in worst)
            )
    assert not bad, '\n'.join(bad)
