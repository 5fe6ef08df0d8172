"""The config refuses what it cannot run: every numeric key has a range, every choice key its
values, null (never 0)
means "all", YAML's 1e-4 is a number, and the run notebooks refuse a parameter they do not have."""

import ast, dataclasses, json, subprocess, sys
from pathlib import Path

import pytest

from memagent.config import (
    PRESETS,
    RANGES,
    Config,
    _numeric,
    apply_overrides,
    config_keys,
    get_key,
    get_preset,
    injected_params,
    load_config,
    refuse_unknown_params,
    save_config,
)

ROOT = Path(__file__).resolve().parents[1]
RUN_NOTEBOOKS = (
    'train',
    'smoke',
    'bench',
    'agemem_audit',
    'agemem_observed',
    'agemem_advantages',
    'rehearsal',
    'simulate',
    'acceptance',
    'launch',
    'parity',
    'loss_parity',
    'plan',
    'gpu_check',
)


def _refused(overrides, *needles):
    with pytest.raises(ValueError) as e:
        get_preset('tiny', overrides)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    return str(e.value)


def _leaf_types(obj=None, prefix=''):
    out = {}
    for f in dataclasses.fields(obj or Config()):
        v = getattr(obj or Config(), f.name)
        if dataclasses.is_dataclass(v):
            out.update(_leaf_types(v, prefix + f.name + '.'))
        else:
            out[prefix + f.name] = f.type
    return out


def test_every_numeric_field_has_a_range():
    numeric = {k for k, t in _leaf_types().items() if _numeric(t)}
    assert numeric == set(RANGES), (numeric - set(RANGES), set(RANGES) - numeric)
    assert {
        'optim.lr',
        'grpo.eps',
        'rollout.top_k',
        'eval.lengths',
        'health.max_empty_steps',
    } <= numeric


def _outside(spec):
    "A value just outside `spec` (for a list key: a list holding one such value)."
    if spec.lo is not None:
        v = spec.lo if spec.lo_open else spec.lo - 1
    else:
        v = spec.hi if spec.hi_open else spec.hi + 1
    return v


@pytest.mark.parametrize('key', sorted(RANGES))
def test_each_range_is_enforced_with_key_value_and_range(key):
    spec, cur = RANGES[key], get_key(get_preset('tiny'), key)
    bad = _outside(spec)
    if isinstance(cur, list):
        bad = [bad] * ((spec.size or (1,))[0] or 1)
    elif isinstance(cur, float) or (cur is None and isinstance(spec.lo, float)):
        bad = float(bad)
    msg = _refused({key: bad}, f"config key '{key}", 'allowed range', str(spec))
    assert repr(bad[0] if isinstance(bad, list) else bad) in msg


@pytest.mark.parametrize(
    'key,value',
    [
        ('optim.lr', float('nan')),
        ('optim.lr', float('inf')),
        ('loss.kl_coef', -float('inf')),
        ('rollout.temperature', float('nan')),
        ('eval.tolerance_pp', float('inf')),
    ],
)
def test_non_finite_numbers_refused(key, value):
    _refused({key: value}, f"config key '{key}'", 'not a finite number')


def test_negative_learning_rate_refused():
    _refused({'optim.lr': -1e-6}, "'optim.lr': -1e-06 is outside the allowed range >= 0")


def test_grpo_eps_must_be_positive():
    _refused({'grpo.eps': 0.0}, "'grpo.eps': 0.0 is outside the allowed range > 0")
    _refused({'grpo.eps': -1e-6}, "'grpo.eps'")


def test_negative_timeouts_and_backoff_refused():
    _refused(
        {'rollout.request_timeout_s': -5.0},
        "'rollout.request_timeout_s': -5.0 is outside the allowed range > 0",
    )
    _refused({'rollout.request_timeout_s': 0.0}, "'rollout.request_timeout_s'")
    _refused(
        {'rollout.backoff_s': -1.0}, "'rollout.backoff_s': -1.0 is outside the allowed range >= 0"
    )
    _refused({'rollout.max_retries': -1}, "'rollout.max_retries'")


def test_top_k_zero_refused():
    _refused({'rollout.top_k': 0}, "'rollout.top_k': 0 is outside the allowed range -1 or >= 1")
    _refused({'rollout.top_k': -2}, "'rollout.top_k'")
    assert get_preset('tiny', {'rollout.top_k': -1}).rollout.top_k == -1
    assert get_preset('tiny', {'rollout.top_k': 20}).rollout.top_k == 20


def test_clip_low_out_of_range_refused():
    _refused({'loss.clip_low': 5.0}, "'loss.clip_low': 5.0 is outside the allowed range [0, 1)")
    _refused({'loss.clip_low': 1.0}, "'loss.clip_low'")
    _refused({'loss.clip_high': -0.1}, "'loss.clip_high'")


def test_empty_eval_lengths_refused():
    _refused({'eval.lengths': []}, "'eval.lengths': [] has 0 items, needs at least 1")
    _refused({'eval.lengths': [50, 0]}, "'eval.lengths[1]': 0 is outside the allowed range >= 1")


def test_negative_tolerance_refused():
    _refused(
        {'eval.tolerance_pp': -1.0}, "'eval.tolerance_pp': -1.0 is outside the allowed range >= 0"
    )
    assert get_preset('tiny', {'eval.tolerance_pp': 0.0}).eval.tolerance_pp == 0.0


@pytest.mark.parametrize('key', ['model.name', 'name', 'model.tokenizer', 'data.train'])
def test_empty_names_refused(key):
    _refused({key: ''}, f"config key '{key}': must not be an empty string")
    _refused({key: '   '}, f"config key '{key}'")


def test_unknown_reward_refused():
    msg = _refused(
        {'grpo.reward': 'boxed_emm'}, "'grpo.reward': 'boxed_emm' is not a registered reward"
    )
    assert "'boxed_em'" in msg and "'answer_in_final'" in msg


def test_zero_counts_are_refused_never_all():
    "0 is not 'all' (null is): a count of 0 that would evaluate or train on nothing is refused."
    _refused(
        {'data.max_eval': 0},
        "'data.max_eval': 0 is outside the allowed range >= 1",
        'null: every example',
    )
    _refused({'data.max_train': 0}, "'data.max_train': 0")
    _refused({'eval.max_items': 0}, "'eval.max_items': 0", 'null: every item')
    c = get_preset('tiny', {'data.max_eval': None, 'eval.max_items': None})
    assert (c.data.max_eval, c.eval.max_items) == (None, None)


@pytest.mark.parametrize(
    'key,value',
    [
        ('rollout.max_retries', 0),
        ('rollout.backoff_s', 0.0),
        ('rollout.temperature', 0.0),
        ('optim.lr', 0.0),
        ('optim.warmup_steps', 0),
        ('loss.kl_coef', 0.0),
        ('eval.temperature', 0.0),
        ('seed', 0),
    ],
)
def test_zero_kept_where_it_means_something(key, value):
    assert get_key(get_preset('tiny', {key: value}), key) == value


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    p = tmp_path / 'c.yaml'
    p.write_text(
        'name: yaml-floats\noptim:\n  lr: 1e-4\n  eps: 1E-8\nloss:\n  kl_coef: 2e-3\ngrpo:\n  '
        'eps: +1e-6\n'
    )
    c = load_config(p)
    assert (c.optim.lr, c.optim.eps, c.loss.kl_coef, c.grpo.eps) == (1e-4, 1e-8, 2e-3, 1e-6)
    assert isinstance(c.optim.lr, float)


def test_yaml_string_that_looks_like_a_number_stays_a_string(tmp_path):
    c = get_preset('tiny')
    c.description = '1e-4'
    c.name = '2E5'
    back = load_config(save_config(c, tmp_path / 's.yaml'))
    assert (back.description, back.name) == ('1e-4', '2E5') and back == c


def test_number_given_as_string_says_why(tmp_path):
    _refused(
        {'optim.lr': '1e-4'},
        "'optim.lr': expected float, got str '1e-4'",
        'a number given as a string',
    )
    p = tmp_path / 'q.yaml'
    p.write_text("optim:\n  lr: '1e-4'\n")
    with pytest.raises(
        ValueError, match=r"q\.yaml: config key 'optim\.lr'.*a number given as a string"
    ):
        load_config(p)


def test_non_finite_yaml_refused_naming_the_file(tmp_path):
    p = tmp_path / 'n.yaml'
    p.write_text('optim:\n  lr: .nan\n')
    with pytest.raises(
        ValueError, match=r"n\.yaml: config key 'optim\.lr': nan \(not a finite number\)"
    ):
        load_config(p)


def test_presets_validate_and_roundtrip_with_health_and_resume_overrides(tmp_path):
    for name in PRESETS:
        c = get_preset(name)
        assert (c.health.max_empty_steps, c.health.check_finite, c.resume_overrides) == (
            3,
            True,
            [],
        )
        assert load_config(save_config(c, tmp_path / f'{name}.yaml')) == c
    c = get_preset(
        'tiny',
        {
            'health.max_empty_steps': 1,
            'health.check_finite': False,
            'resume_overrides': ['schedule.steps', 'optim.lr'],
        },
    )
    back = load_config(save_config(c, tmp_path / 'h.yaml'))
    assert (
        back == c
        and back.resume_overrides == ['schedule.steps', 'optim.lr']
        and back.health.check_finite is False
    )
    assert (
        'health:\n  max_empty_steps: 1\n  check_finite: false\n  stall_timeout_s: '
        '900.0\nresume_overrides:\n- schedule.steps\n' in (tmp_path / 'h.yaml').read_text()
    )


def test_health_max_empty_steps_at_least_one():
    _refused(
        {'health.max_empty_steps': 0},
        "'health.max_empty_steps': 0 is outside the allowed range >= 1",
    )
    _refused({'health.check_finite': 'yes'}, "'health.check_finite': expected bool")


def test_resume_overrides_must_be_known_keys():
    _refused(
        {'resume_overrides': ['schedule.step']},
        "'resume_overrides[0]': 'schedule.step' is not a config key",
        "did you mean ['schedule.steps'",
    )
    _refused({'resume_overrides': ['optim']}, "'resume_overrides[0]': 'optim' is not a config key")
    _refused({'resume_overrides': 'schedule.steps'}, "'resume_overrides': expected list[str]")
    assert 'health.check_finite' in config_keys() and 'optim' not in config_keys()
    assert get_preset('tiny', {'resume_overrides': config_keys()}).resume_overrides == config_keys()


def test_refuse_unknown_params():
    ns = {
        'In': [
            '',
            'preset = "tiny"',
            '# Parameters\npreset = "tiny"\nstepz = 2\nPAPERMILL_INPUT_PATH = "x"\n',
            'cur',
        ]
    }
    assert injected_params(ns) == ['preset', 'stepz', 'PAPERMILL_INPUT_PATH']
    with pytest.raises(
        ValueError,
        match=(
            r"unknown parameter 'stepz' \(did you mean 'steps'\?\): this notebook's parameters "
            r"are \['preset', 'steps'\]"
        ),
    ):
        refuse_unknown_params(ns, 'preset steps')
    refuse_unknown_params(ns, ['preset', 'stepz'])
    # nothing injected: nothing to refuse
    refuse_unknown_params({'In': ['', 'stepz = 1']}, ['preset'])


def _nb_cells(name):
    return json.loads((ROOT / 'nbs' / f'{name}.ipynb').read_text())['cells']


def _param_names(src):
    "The names a parameters cell assigns, each declared with its type (`name: type = value`)."
    body = ast.parse(src).body
    return [
        t.id
        for n in body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    ] + [
        n.target.id for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


@pytest.mark.parametrize('name', RUN_NOTEBOOKS)
def test_run_notebook_checks_its_parameters_right_after_the_parameters_cell(name):
    """The cell after `parameters` calls the shared check with exactly the names the parameters cell
    assigns."""
    cells = [c for c in _nb_cells(name) if c['cell_type'] == 'code']
    i = next(
        i for i, c in enumerate(cells) if 'parameters' in c.get('metadata', {}).get('tags', [])
    )
    params = _param_names(''.join(cells[i]['source']))
    tree = ast.parse(''.join(cells[i + 1]['source']))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and getattr(n.func, 'id', getattr(n.func, 'attr', None)) == 'refuse_unknown_params'
    ]
    assert len(calls) == 1, (
        f"{name}: the cell after the parameters cell must call refuse_unknown_params"
    )
    known = ast.literal_eval(calls[0].args[1])
    assert (known.split() if isinstance(known, str) else list(known)) == params, name
    body = tree.body  # nothing but the import of the check runs before it
    at = next(j for j, n in enumerate(body) if any(c is calls[0] for c in ast.walk(n)))
    assert all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in body[:at]) and at <= 1, name


# agemem_audit and parity take folders (paths by design), no run name
RUN_NAME_PARAM = {
    'train': 'run',
    'smoke': 'run',
    'bench': 'run',
    'rehearsal': 'run',
    'simulate': 'run',
    'acceptance': 'run_name',
    'launch': 'run',
    'plan': 'run',
}


@pytest.mark.parametrize('name', RUN_NOTEBOOKS)
def test_run_notebook_confines_its_run_name_to_one_folder(name):
    """The parameter check of each run notebook, run directly (its parameters cell, then its check
    cell up to the run-name
        rule): a run name that would leave the output folder is refused, naming the parameter,
        before
        anything is written."""
    cells = [c for c in _nb_cells(name) if c['cell_type'] == 'code']
    i = next(
        i for i, c in enumerate(cells) if 'parameters' in c.get('metadata', {}).get('tags', [])
    )
    params, tree = ''.join(cells[i]['source']), ast.parse(''.join(cells[i + 1]['source']))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, 'id', None) == 'folder_name'
    ]
    if name not in RUN_NAME_PARAM:
        assert not calls and not any(p in ('run', 'run_name') for p in _param_names(params)), name
        return
    param = RUN_NAME_PARAM[name]
    assert [c.args[0].id for c in calls] == [param], name
    at = next(j for j, n in enumerate(tree.body) if any(c is calls[0] for c in ast.walk(n)))
    check = ast.Module(body=tree.body[: at + 1], type_ignores=[])
    for bad in ('../elsewhere', '/tmp/elsewhere', 'a/b', '..'):
        ns = {}
        exec(compile(params, f'{name}:parameters', 'exec'), ns)
        ns[param] = bad
        with pytest.raises(ValueError, match=f'parameter {param}: '):
            exec(compile(check, f'{name}:check', 'exec'), ns)
    ns = {}
    exec(compile(params, f'{name}:parameters', 'exec'), ns)
    exec(compile(check, f'{name}:check', 'exec'), ns)  # the default passes


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    'name,misspelt,known',
    [
        ('train', 'eval_itemz', 'eval_items'),
        ('smoke', 'stepz', 'steps'),
        ('bench', 'n_trajs', 'n_traj'),
        ('agemem_audit', 'mod', 'mode'),
        ('acceptance', 'tolerance', 'tolerance_pp'),
    ],
)
def test_run_notebook_refuses_unknown_parameter(tmp_path, name, misspelt, known):
    pytest.importorskip('papermill')
    out = tmp_path / 'out'
    cmd = [
        sys.executable,
        '-m',
        'papermill',
        str(ROOT / 'nbs' / f'{name}.ipynb'),
        str(tmp_path / 'o.ipynb'),
        '--cwd',
        str(ROOT),
        '--no-progress-bar',
        '-k',
        'python3',
        '-p',
        misspelt,
        '1',
    ]
    if name == 'train':
        cmd += ['-p', 'out_dir', str(out), '-p', 'report_dir', str(out)]
    if name == 'smoke':
        cmd += ['-p', 'out_dir', str(out), '-p', 'report_dir', str(out)]
    if name == 'bench':
        cmd += ['-p', 'out_root', str(out)]
    if name == 'agemem_audit':
        cmd += ['-p', 'report_dir', str(out)]
    if name == 'acceptance':
        cmd += ['-p', 'out_root', str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text[-3000:]
    assert f"unknown parameter {misspelt!r} (did you mean {known!r}?)" in text, text[-3000:]
    assert not out.exists(), 'nothing may be written before the parameters are checked'


def test_server_urls_that_nothing_would_read_are_refused():
    """rollout.sglang_urls with the in-process engine, or with colocated engines, would be silently
    unused: refused naming the key and the fix."""
    from memagent.config import get_preset

    with pytest.raises(
        ValueError,
        match=(
            r"'rollout.sglang_urls': 1 server URL\(s\) set, but rollout.engine='hf' runs in the "
            r"driver"
        ),
    ):
        get_preset('tiny', {'rollout.sglang_urls': ['http://127.0.0.1:30000']})
    with pytest.raises(
        ValueError, match=r"'rollout.sglang_urls'.*rollout.colocate=True launches its own engines"
    ):
        get_preset('qwen3-4b-frozen', {'rollout.sglang_urls': ['http://127.0.0.1:30000']})
    c = get_preset(
        'tiny', {'rollout.engine': 'sglang', 'rollout.sglang_urls': ['http://127.0.0.1:30000']}
    )
    assert c.rollout.sglang_urls == ['http://127.0.0.1:30000']


def test_every_run_notebook_is_listed():
    """Every notebook with a `parameters` cell is a run notebook the tests below cover: a new one is
    covered the day it is added."""
    found = {
        p.stem
        for p in (ROOT / 'nbs').glob('*.ipynb')
        if any(
            'parameters' in c.get('metadata', {}).get('tags', [])
            for c in json.loads(p.read_text())['cells']
        )
    }
    assert found == set(RUN_NOTEBOOKS), found ^ set(RUN_NOTEBOOKS)


@pytest.mark.parametrize('name', RUN_NOTEBOOKS)
def test_run_notebook_declares_and_holds_every_parameter_type(name, tmp_path, monkeypatch):
    """Every parameter is declared with its type, and the check cell holds each to it before
    anything is written: a bool
        given as papermill's text ('false') is refused with the `-y` hint, a number as text, NaN or
        a
        float where an int goes too."""
    from memagent.testing import run_notebook_cells

    cells = [c for c in _nb_cells(name) if c['cell_type'] == 'code']
    i = next(
        i for i, c in enumerate(cells) if 'parameters' in c.get('metadata', {}).get('tags', [])
    )
    src = ''.join(cells[i]['source'])
    body = ast.parse(src).body
    assert all(isinstance(n, ast.AnnAssign) for n in body), (
        f"{name}: every parameter is declared as `name: type = value`"
    )
    ns = {}
    exec(src, ns)
    monkeypatch.chdir(tmp_path)  # anything written by mistake lands here, and is caught below
    for p, t in ns['__annotations__'].items():
        t = str(t)
        bads = (
            (['false'] if 'bool' in t and 'str' not in t else [])
            + ([2.5] if 'int' in t and 'float' not in t else [])
            + (['3'] if 'int' in t and 'str' not in t else [])
            + ([float('nan')] if 'float' in t else [])
        )
        for bad in bads:
            _, err = run_notebook_cells(ROOT / 'nbs' / f'{name}.ipynb', {p: bad}, cells=1)
            assert isinstance(err, ValueError) and f'parameter {p}:' in str(err), (
                name,
                p,
                bad,
                err,
            )
            if bad == 'false':
                assert f"-y '{p}: false'" in str(err), (name, p, str(err))
    assert list(tmp_path.iterdir()) == [], (name, list(tmp_path.iterdir()))
