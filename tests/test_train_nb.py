"""The main job's notebook through papermill on the tiny preset: row counts, checkpoint, export,
reward summary, report."""

import json, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


def test_train_notebook_tiny(tmp_path):
    out, runs, reps = tmp_path / 'out.ipynb', tmp_path / 'runs', tmp_path / 'reports'
    cmd = [
        sys.executable,
        '-m',
        'papermill',
        str(ROOT / 'nbs' / 'train.ipynb'),
        str(out),
        '--cwd',
        str(ROOT),
        '-p',
        'preset',
        'tiny',
        '-p',
        'steps',
        '2',
        '-p',
        'run',
        'ci',
        '-p',
        'out_dir',
        str(runs),
        '-p',
        'report_dir',
        str(reps),
        '-y',
        'overrides: {grpo.reward: answer_without_distractors}',
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stderr[-3000:]
    run, rep = runs / 'ci', reps / 'ci'
    steps = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
    assert [m['step'] for m in steps] == [1, 2]
    for m in steps:
        assert (
            m['rows_generated'] + m['rows_padding']
            == m['rows_transferred']
            == m['rows_consumed']
            > 0
        )
        dump = [json.loads(l) for l in open(run / 'rollouts' / f"step_{m['step']:06d}.jsonl")]
        # every turn of every trajectory is one row
        assert m['rows_generated'] == sum(len(t['turns']) for t in dump)
    assert (run / 'checkpoints' / 'latest').read_text() == 'step_000002'
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / 'hf')
    assert (
        model.generate(
            __import__('torch').tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False
        ).shape[1]
        == 5
    )
    summ = json.loads((rep / 'reward_summary.json').read_text())
    assert summ['steps'] == 2 and 'delta' in summ and summ['provenance']
    readme = (rep / 'README.md').read_text()
    for head in (
        '## Result',
        '## Held-out evaluation',
        '## What the memory holds',
        '## What the trained agent writes',
        '## Per-step metrics',
        '## Provenance',
    ):
        assert head in readme
    # the key-code task: held-out keys unseen, the needle's chunk known, so the needs-memory subset,
    # retention and viewer exist
    held = json.loads((rep / 'heldout.json').read_text())
    assert (
        held['questions_shared_with_training'] == 0
        and held['reward'] == 'answer_without_distractors'
    )
    sub = {s['subset']: s for s in held['subsets']}
    assert (
        sub['needs memory (gold before the last chunk)']['records']
        + sub['gold in the last chunk']['records']
        == held['items']
        == 4
    )
    ret = json.loads((rep / 'retention.json').read_text())
    assert set(ret['models']) == {'base', 'trained'}
    # every record is anchored at its needle's chunk; offset 0 counts them all
    for m in ret['models'].values():
        assert (
            m['skipped'] == {}
            and m['by_offset']['0'][1] == 4
            and sum(n for _, n in m['by_anchor'].values()) == 4
        )
    assert (rep / 'retention.png').stat().st_size > 1000
    traj = (rep / 'trajectories.md').read_text()
    assert (
        traj.count('| answer |') == 4
        and '(gold) |' in traj
        and 'base: memory after the chunk | trained: memory after the chunk' in traj
    )
    recs = [json.loads(l) for l in open(run / 'eval' / 'trained' / 'records.jsonl')]
    # the memory after every chunk is kept
    assert all(len(r['memories']) == r['num_chunks'] == 3 for r in recs)
    assert (rep / 'reward_curve.png').stat().st_size > 1000
    for name in ('base', 'trained'):
        assert (run / 'eval' / name / 'summary.json').exists()
    # the same run again with another learning rate: the notebook's own cells, up to where they
    # would write, refuse it (the trainer's resume check, run before the data are written) and leave
    # both folders byte-identical
    before = _tree(runs) | _tree(reps)
    from memagent.resume import ResumeError

    with pytest.raises(ResumeError, match=r"optim\.lr: .* in the checkpoint, 0\.5 now"):
        _run_cells_until_first_write(
            {
                'preset': 'tiny',
                'steps': 2,
                'run': 'ci',
                'out_dir': str(runs),
                'report_dir': str(reps),
                'overrides': {'grpo.reward': 'answer_without_distractors', 'optim.lr': 0.5},
            }
        )
    assert _tree(runs) | _tree(reps) == before, 'a refused rerun changed the run or its report'


def _tree(root):
    "Every file under `root` with its bytes."
    return {str(p): p.read_bytes() for p in sorted(Path(root).rglob('*')) if p.is_file()}


def _run_cells_until_first_write(params):
    """The train notebook's code cells as papermill runs them (its parameters cell, then `params`),
    up to the one that writes the data."""
    cells = [
        ''.join(c['source'])
        for c in json.loads((ROOT / 'nbs' / 'train.ipynb').read_text())['cells']
        if c['cell_type'] == 'code'
    ]
    ns = {}
    exec(cells[0], ns)
    ns.update(params)
    for src in cells[1:]:
        exec(src, ns)
        if 'write_examples(train_examples' in src:
            break


def test_train_notebook_rejects_bad_preset(tmp_path):
    cmd = [
        sys.executable,
        '-m',
        'papermill',
        str(ROOT / 'nbs' / 'train.ipynb'),
        str(tmp_path / 'o.ipynb'),
        '--cwd',
        str(ROOT),
        '-p',
        'preset',
        'nope',
        '-p',
        'out_dir',
        str(tmp_path),
        '-p',
        'report_dir',
        str(tmp_path),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "preset='nope'" in (r.stderr + r.stdout)


@pytest.mark.parametrize(
    'params,needle',
    [
        (
            ['-p', 'eval_items', '0'],
            "parameter eval_items=0: must be an int >= 1",
        ),  # 0 is not "all" (was: 32 items)
        (
            ['-p', 'eval_itemz', '4'],
            "unknown parameter 'eval_itemz' (did you mean 'eval_items'?)",
        ),  # was: a warning
        (
            ['-y', 'overrides: {data.max_eval: 0}'],
            "config key 'data.max_eval': 0 is outside the allowed range >= 1",
        ),
    ],
)
def test_train_notebook_refuses_bad_parameters_before_running(tmp_path, params, needle):
    cmd = [
        sys.executable,
        '-m',
        'papermill',
        str(ROOT / 'nbs' / 'train.ipynb'),
        str(tmp_path / 'o.ipynb'),
        '--cwd',
        str(ROOT),
        '-p',
        'preset',
        'tiny',
        '-p',
        'out_dir',
        str(tmp_path / 'runs'),
        '-p',
        'report_dir',
        str(tmp_path / 'reports'),
        *params,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and needle in (r.stderr + r.stdout), (r.stderr + r.stdout)[-3000:]
    assert not (tmp_path / 'runs').exists(), (
        'nothing may be written before the parameters are checked'
    )
