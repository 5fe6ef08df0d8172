"""nbs/gpu_check.ipynb, the one-GPU subset as a run notebook, run in this process with CPU
parameters: a part runs
through the same driver as `gpu_check.sh` and its report lands under `out`; a wrong parameter is
refused before
anything is written."""

import json
from pathlib import Path
import pytest
from memagent.testing import run_notebook_cells

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / 'nbs' / 'gpu_check.ipynb'


@pytest.mark.timeout(600)
def test_the_run_notebook_runs_a_part_on_cpu_and_reports_it(tmp_path):
    out = tmp_path / 'subset'
    ns, err = run_notebook_cells(
        NB, {'out': str(out), 'cpu_simulation': True, 'parts': ['step4b-sdpa-selective']}
    )
    assert err is None, err
    rep = json.loads((out / 'subset.json').read_text())
    assert rep['cpu_simulation'] and rep['reduced_layout'] == 'cpu-simulation' and rep['pass'], rep[
        'parts'
    ]['step4b-sdpa-selective']
    v = {n: p['verdict'] for n, p in rep['parts'].items()}
    assert v['step4b-sdpa-selective'] == 'passed' and v['megatron'] == 'not run', v
    st = rep['parts']['step4b-sdpa-selective']['results']['step']
    # timed on CPU too
    assert set(st['phases_s']) == {
        'forward',
        'backward (with recompute)',
        'optimizer step',
    }
    assert (
        st['split_checks']['checks']['phases']['agrees'] is not None
        and 'kernels' not in st['split_checks']['checks']
    )
    md = (out / 'subset.md').read_text()
    assert (
        md.startswith('layout: reduced (cpu-simulation')
        and '(cpu-simulation: a code-path check' in md
    )


@pytest.mark.parametrize(
    'params, says',
    [
        ({'parts': ['nope']}, 'parts must be None or a non-empty list'),
        (
            {'cpu_simulation': 'yes'},
            "parameter cpu_simulation: 'yes' is not of its declared type bool",
        ),
        ({'outt': 'x', 'In': ['# Parameters\nouttt = "x"\n']}, "unknown parameter 'outtt'"),
    ],
)
def test_a_wrong_parameter_is_refused_before_anything_is_written(tmp_path, params, says):
    ns, err = run_notebook_cells(
        NB, {'out': str(tmp_path / 'o'), 'cpu_simulation': True, **params}, cells=1
    )
    assert err is not None and says in str(err), err
    assert not (tmp_path / 'o').exists()
