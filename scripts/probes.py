#!/usr/bin/env python
"""Probe variants of the embedded default's key-code task: each one trains a fixed number of steps
with the train
notebook and evaluates base vs trained on the same held-out items; the table says which variant the
default uses.

    python scripts/probes.py                       # every variant, then the report in
    reports/probes/cpu-demo/ python scripts/probes.py --only m24-t06        # one variant (finished
    variants are kept and not re-run) python scripts/probes.py --collect             # only render
    the report from the finished variants

Each variant is one papermill run of nbs/train.ipynb (preset cpu-demo, the overrides below, --steps
steps) into runs/probes/<variant>/, its own report into runs/probes/reports/<variant>/ (not
committed). The committed report holds the table, the per-variant held-out numbers and the
provenance; it is written only from a clean tree.
"""

import argparse, json, os, subprocess, sys, time
import yaml
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> (overrides of the cpu-demo preset, what it changes). A bounded grid: the first setting (3
# pairs, lr 3e-5), then one change at a time from the second row (the first row's policy collapsed
# to a 3-token memory, see its row). The overrides name every setting a row changes from today's
# preset, so a row re-run now trains with the settings it was measured with.
_FIRST = {'data.keycode_pairs': 3}
VARIANTS = {
    'm24-t06': (
        {**_FIRST, 'optim.lr': 3e-5},
        '3 pairs, 3 chunks of 48 tokens, memory 24, temperature 0.6, lr 3e-5',
    ),
    'm24-t06-lr1e5': ({**_FIRST, 'optim.lr': 1e-5}, 'lr 1e-5'),
    'p2-m24-t06-lr1e5': (
        {'data.keycode_pairs': 2, 'optim.lr': 1e-5},
        'lr 1e-5, 2 pairs: one distractor, one chunk of filler only',
    ),
    'm16-t06-lr1e5': (
        {**_FIRST, 'optim.lr': 1e-5, 'chunking.memory_tokens': 16},
        'lr 1e-5, memory 16: a third of a chunk',
    ),
    'm24-t10-lr1e5': (
        {**_FIRST, 'optim.lr': 1e-5, 'rollout.temperature': 1.0, 'eval.temperature': 1.0},
        "lr 1e-5, temperature 1.0 (the GPU recipes' value)",
    ),
}

# what the table cannot show by itself
NOTES = {
    'm24-t06': (
        'shared the 2 cores with test runs during most of its training: its wall time is not '
        'comparable'
    )
}


def run_variant(name, steps, runs):
    ov, _ = VARIANTS[name]
    rep = runs / 'reports' / name
    if (rep / 'heldout.json').is_file():
        print(f'{name}: finished earlier, kept')
        return
    # YAML's own writer: 1e-5 as 1.0e-05, which YAML reads as a number
    cmd = [
        sys.executable,
        '-m',
        'papermill',
        str(ROOT / 'nbs' / 'train.ipynb'),
        str(runs / f'{name}.ipynb'),
        '--cwd',
        str(ROOT),
        '-p',
        'steps',
        str(steps),
        '-p',
        'run',
        name,
        '-p',
        'out_dir',
        str(runs),
        '-p',
        'report_dir',
        str(runs / 'reports'),
        '-y',
        yaml.safe_dump({'overrides': ov}),
    ]
    t0, load0 = time.time(), os.getloadavg()[0]
    print(f'{name}: {" ".join(cmd)}', flush=True)
    subprocess.run(cmd, check=True)
    (runs / 'reports' / name / 'probe.json').write_text(
        json.dumps(
            {
                'wall_s': time.time() - t0,
                'load_avg_1m_start': load0,
                'load_avg_1m_end': os.getloadavg()[0],
                'steps': steps,
            }
        )
    )


def collect(runs, out, steps):
    sys.path.insert(0, str(ROOT))
    from memagent.provenance import provenance
    from memagent.report import md_table, write_report

    rows, table = {}, []
    for name, (ov, what) in VARIANTS.items():
        rep = runs / 'reports' / name
        if not (rep / 'heldout.json').is_file():
            print(f'{name}: not run, left out of the table')
            continue
        h, rs, pr = (
            json.loads((rep / f).read_text())
            for f in ('heldout.json', 'reward_summary.json', 'probe.json')
        )
        sub = {s['subset']: s for s in h['subsets']}
        # the last training step's metrics
        last = json.loads((runs / name / 'metrics.jsonl').read_text().splitlines()[-1])
        allr, mem = sub['all held-out records'], sub['needs memory (gold before the last chunk)']
        rows[name] = {
            'overrides': ov,
            'config_as_run': yaml.safe_load((rep / 'config.yaml').read_text()),
            'what': what,
            'steps': pr['steps'],
            'reward_first_window': rs['first_window_mean'],
            'reward_last_window': rs['last_window_mean'],
            'all': allr,
            'needs_memory': mem,
            'by_gold_chunk': h['by_gold_chunk'],
            'last_step': {k: last[k] for k in ('kl', 'memory_tokens_mean', 'entropy')},
            'wall_s': pr['wall_s'],
            'load_avg_1m': [pr['load_avg_1m_start'], pr['load_avg_1m_end']],
            'commit': h['provenance']['git']['commit'],
            'dirty': h['provenance']['git']['dirty'],
            'data': h['data'],
        }
        table.append(
            {
                'variant': name,
                'what changes': what,
                'steps': pr['steps'],
                'train reward first -> last 5': (
                    f"{rs['first_window_mean']:.2f} -> {rs['last_window_mean']:.2f}"
                ),
                'held-out base %': allr['base_pct'],
                'trained %': allr['trained_pct'],
                'needs memory: base %': mem['base_pct'],
                'needs memory: trained %': mem['trained_pct'],
                'diff pp [95% CI]': (
                    f"{mem['diff_pp']:+.1f} [{mem['ci_pp'][0]:+.1f}, {mem['ci_pp'][1]:+.1f}]"
                ),
                'last step: kl': f"{last['kl']:.3f}",
                'memory tokens': last['memory_tokens_mean'],
                'wall min': pr['wall_s'] / 60,
                'load': f"{pr['load_avg_1m_start']:.1f}-{pr['load_avg_1m_end']:.1f}",
                'note': NOTES.get(name, ''),
            }
        )
    if not rows:
        raise SystemExit('probes: no finished variant to report')
    not_run = [f"`{k}` ({v[1]})" for k, v in VARIANTS.items() if k not in rows]
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance(params={'steps': steps, 'variants': {k: v[0] for k, v in VARIANTS.items()}})
    (out / 'probes.json').write_text(
        json.dumps(
            {
                'variants': rows,
                'not_run': [k for k in VARIANTS if k not in rows],
                'provenance': prov,
            },
            indent=1,
            default=str,
        )
    )
    commits = sorted({r['commit'][:7] + (' (dirty)' if r['dirty'] else '') for r in rows.values()})
    body = (
        f"Each variant trains {steps} steps from the `cpu-demo` preset with the overrides in "
        "`probes.json`, then base and trained are "
        f"evaluated on the same held-out items (keys never seen in training). 'needs memory': the "
        "records whose asked key sits "
        f"before the last chunk. Wall time includes both evaluations; the load average (1 min) at "
        "start and end is beside it. "
        f"'last step': the KL to the reference and the mean memory length (tokens) at the last "
        "training step. "
        f"Each row records the full config it ran with (`config_as_run`) and its commit (the "
        "preset then had 3 pairs and lr 3e-5; the overrides name every "
        "setting a row changes from today's preset, which holds the chosen row's). Commits: "
        f"{commits}.\n\n"
        + md_table(table, floatfmt='.1f')
        + (f"\n\nListed but not run, so not measured: {', '.join(not_run)}." if not_run else '')
    )
    write_report(
        out,
        'Probes of the embedded default\'s key-code task',
        [('Variants', body)],
        files=[out / 'probes.json'],
    )
    print((out / 'README.md').read_text())


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--steps', type=int, default=12)
    ap.add_argument('--only', nargs='*', default=None, choices=list(VARIANTS))
    ap.add_argument(
        '--collect', action='store_true', help='only render the report from finished variants'
    )
    ap.add_argument('--runs', default=str(ROOT / 'runs' / 'probes'))
    ap.add_argument('--out', default=str(ROOT / 'reports' / 'probes' / 'cpu-demo'))
    a = ap.parse_args()
    # every refusal exits 2 here, before hours of training and before anything is written
    if a.steps < 1:
        ap.error(f"--steps {a.steps}: must be a positive integer")
    if a.only == []:
        ap.error(
            f"--only names no variant (name one or more of {list(VARIANTS)}, or leave --only out "
            "for all)"
        )
    from memagent.provenance import refuse_unclean_report_dir

    try:
        refuse_unclean_report_dir(Path(a.out), 'probes.py --out')
    except ValueError as e:
        ap.error(str(e))
    runs = Path(a.runs)
    if a.collect and not runs.is_dir():
        ap.error(f"--collect: no runs folder {runs}")
    if not a.collect:
        runs.mkdir(parents=True, exist_ok=True)
        for name in a.only or VARIANTS:
            run_variant(name, a.steps, runs)
    collect(runs, Path(a.out), a.steps)
