"""The report files README.md's figures are read from (scripts/readme.py reads this dict as a
literal, with `ast`,
without running anything). Each `file` lies under reports/ and its `*` must match exactly one file.
JSON files are
read by key path; markdown files through `fields`, one regular expression with one group each, which
must match
exactly once. `commit` and `dirty` name where the report records the git state of its run."""

readme_sources = {
    'train': {
        'file': 'reports/train/acceptance-reference/reward_summary.json',
        'commit': 'train.provenance.git.commit',
        'dirty': 'train.provenance.git.dirty',
    },
    'train_md': {
        'file': 'reports/train/acceptance-reference/README.md',
        'commit': 'train_md.commit',
        'fields': {
            'wall_min': r'^- Wall time: ([0-9.]+) min in total',
            'commit': r'^- git: `([0-9a-f]{40})` \(clean\)',
        },
    },
    'held': {
        'file': 'reports/train/acceptance-reference/heldout.json',
        'commit': 'held.provenance.git.commit',
        'dirty': 'held.provenance.git.dirty',
    },
    'acc': {
        'file': 'reports/acceptance/cpu-demo/compare.json',
        'commit': 'acc.provenance.git.commit',
        'dirty': 'acc.provenance.git.dirty',
    },
    'probes': {
        'file': 'reports/probes/cpu-demo/probes.json',
        'commit': 'probes.provenance.git.commit',
        'dirty': 'probes.provenance.git.dirty',
    },
    'smoke': {'file': 'reports/smoke/cpu-tiny/gates.json', 'commit': 'smoke_md.commit'},
    'smoke_md': {
        'file': 'reports/smoke/cpu-tiny/README.md',
        'fields': {'commit': r'^- git: `([0-9a-f]{40})` \(clean\)'},
    },
    'bench': {
        'file': 'reports/bench/cpu/bench.json',
        'commit': 'bench.provenance.git.commit',
        'dirty': 'bench.provenance.git.dirty',
    },
    'audit': {
        'file': 'reports/agemem_audit/receipt.json',
        'commit': 'audit.provenance.git.commit',
        'dirty': 'audit.provenance.git.dirty',
    },
    'observed': {
        'file': 'reports/agemem_observed/receipt.json',
        'commit': 'observed.provenance.git.commit',
        'dirty': 'observed.provenance.git.dirty',
    },
    'advantages': {
        'file': 'reports/agemem_advantages/receipt.json',
        'commit': 'advantages.provenance.git.commit',
        'dirty': 'advantages.provenance.git.dirty',
    },
    'parity': {
        'file': 'reports/parity/receipt.json',
        'commit': 'parity.provenance.git.commit',
        'dirty': 'parity.provenance.git.dirty',
    },
    'rehearsal': {
        'file': 'reports/rehearsal/cpu-frozen/rehearsal.json',
        'commit': 'rehearsal.provenance.git.commit',
        'dirty': 'rehearsal.provenance.git.dirty',
    },
    'rehearsal_md': {
        'file': 'reports/rehearsal/cpu-frozen/README.md',
        'commit': 'rehearsal.provenance.git.commit',
        'fields': {'peak': r'^\*\*Peak resident memory\*\*: ([0-9.]+) GiB summed'},
    },
    'simulation': {
        'file': 'reports/bench/simulation/results.json',
        'commit': 'simulation.provenance.git.commit',
        'dirty': 'simulation.provenance.git.dirty',
    },
    'plan': {
        'file': 'reports/plan/qwen3-4b-frozen-8x80/plan.json',
        'commit': 'plan.provenance.git.commit',
        'dirty': 'plan.provenance.git.dirty',
    },
    'launch': {
        'file': 'reports/launch/sim-8gpu/launch.json',
        'commit': 'launch.provenance.git.commit',
        'dirty': 'launch.provenance.git.dirty',
    },
    'loss_parity': {
        'file': 'reports/loss_parity/receipt.json',
        'commit': 'loss_parity.provenance.git.commit',
        'dirty': 'loss_parity.provenance.git.dirty',
    },
    'gpu': {
        'file': 'reports/smoke/gpu-20261204-step4b/subset/subset.json',
        'commit': 'gpu.provenance.git.commit',
        'dirty': 'gpu.provenance.git.dirty',
    },
}
