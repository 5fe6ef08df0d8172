"""Export cells hold one idea each: no `#| export` cell is over 60 lines, as ruff formats it.

A long cell is split at its top-level statements into consecutive export cells. A long class is laid
out one method per cell with `memagent.patch.patch_to`; a long function is split into helpers. A
definition that cannot be split without harm is listed in `LONG_DEFINITIONS` with its reason, and
`PENDING` lists the long cells not split yet. Both lists only shrink: an entry whose cell is gone or
is now at most 60 lines fails the test until it is removed."""

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60

LONG_DEFINITIONS = {
    (
        'nbs/00_config.ipynb',
        '0770237e',
    ): 'one class, Config (a dataclass of the sections and its checks), of 111 lines',
    (
        'nbs/09_rollout.ipynb',
        'c8060213',
    ): 'one function, rollout (its docments take a line per parameter), of 68 lines',
    (
        'nbs/16b_acceptance_1_gate.ipynb',
        'd785d399',
    ): (
        'one function, compare (every check of the rule in order, a docment per parameter), of 90 '
        'lines'
    ),
    (
        'nbs/16_evaluate.ipynb',
        '8bf7fe2b',
    ): 'one function, evaluate (a docment per parameter), of 73 lines',
    ('nbs/08_engines_2_hf.ipynb', '295d0159'): 'one class, HFEngine, of 158 lines',
    ('nbs/08_engines_4_sglang.ipynb', 'f72abd87'): 'one class, SGLangEngine, of 274 lines',
    ('nbs/08a_colocate.ipynb', 'e12b6896'): 'one class, Placement, of 71 lines',
    ('nbs/09b_simulate.ipynb', '3fad0f5a'): 'one class, SimEngine, of 69 lines',
    (
        'nbs/11a_ondevice.ipynb',
        '8f545f66',
    ): 'one class, VirtualDevice, of 98 lines (a TorchFunctionMode whose methods call super())',
    ('nbs/12a_torch_backend.ipynb', '334769f2'): 'one class, TorchBackend, of 69 lines',
    ('nbs/12c_ray_group.ipynb', '61cbe336'): 'one class, RayGroup, of 93 lines',
    ('nbs/14_megatron_4_optim.ipynb', '3a98b673'): 'one class, MegatronCoreOptimizer, of 72 lines',
    ('nbs/14_megatron_5_backend.ipynb', 'cc2cca0f'): 'one class, MegatronBackend, of 222 lines',
    ('nbs/14b_plan_2_fit.ipynb', '684f7f23'): 'one class, Plan, of 82 lines (a dataclass)',
    ('nbs/14b_plan_2_fit.ipynb', '5a1af127'): 'one function, _terms, of 112 lines',
    ('nbs/18_audit_1_report.ipynb', '485e044f'): 'one function, _verify, of 61 lines',
    ('nbs/18a_observed_1_store.ipynb', 'c48c4729'): 'one class, Recorder, of 110 lines',
    ('nbs/19_screening.ipynb', '83e09718'): 'one function, screen, of 72 lines',
    ('nbs/20_testing.ipynb', '430e66bf'): 'one class, FakeSGLangServer, of 222 lines',
    ('nbs/20a_simnode.ipynb', 'ddfac68a'): 'one class, SimulatedNode, of 66 lines',
    ('nbs/22_gpucheck_4_step4b.ipynb', '28dd55a0'): 'one function, part_step4b, of 80 lines',
    ('nbs/22_gpucheck_5_report.ipynb', 'ca97dc51'): 'one function, render_md, of 128 lines',
    ('nbs/22_gpucheck_6_cli.ipynb', '92df285f'): 'one function, cmd_compare, of 71 lines',
}

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
