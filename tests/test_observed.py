"""The AgeMem second study: the committed receipt verifies and shows the three contrasts the study
is for; every displayed field
edited (a log entry, a difference, the prose, the environment, the provenance, the report, the
episodes with their hash) is
refused, and a receipt of the wrong shape fails with a reason. Stage-3 rounds count as the workflow
collects them, and the
corrections after the run amend only the expectations that count enters, from their registered
values. The report is checked as a reader sees it: README.md states the
SHA-256 of the differences.png it shows, so a swapped figure, an edited README, or either one
missing fails, naming the file. Each judge-free episode is also scored with the local judge
on, and only the memory component moves. With an upstream checkout at $AGEMEM_SRC, a fresh run
reproduces
the committed cases, a modified checkout is refused before anything is written, and upstream's own
Stage-3 loop, run on each
episode's replies, collects the receipt's finished_at_round."""

import configparser, json, os, shutil, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memagent.audit import AUDITED_REVISION, AuditRefused, VerificationError, check_checkout
from memagent.provenance import sha256_file
from memagent.observed import (
    EPISODES_SHA256,
    STORE_MODULE,
    OBSERVED_FILES,
    audit_cli,
    render_report,
    run_observed,
    verify_observed,
)

REPORT = ROOT / 'reports' / 'agemem_observed'
FILES = (
    'episodes.json',
    'protocol.md',
    'corrections.json',
    'corrections.md',
    'receipt.json',
    'README.md',
    'differences.png',
)
SRC = os.environ.get('AGEMEM_SRC')
needs_src = pytest.mark.skipif(
    not (SRC and Path(SRC).is_dir()),
    reason='AGEMEM_SRC is not set to an upstream AgeMem checkout '
    'at the pinned revision; the full run is skipped (the verification tests still run)',
)


def _case(rc, cid):
    return next(c for c in rc['cases'] if c['id'] == cid)


def _copy(tmp_path, edit=None, make=None) -> Path:
    "A copy of the report folder whose receipt `edit` changes in place, or `make` replaces."
    for f in FILES:
        shutil.copy(REPORT / f, tmp_path / f)
    if edit or make:
        rc = json.loads((tmp_path / 'receipt.json').read_text())
        if edit:
            edit(rc)
        else:
            rc = make(rc)
        (tmp_path / 'receipt.json').write_text(json.dumps(rc, indent=1, ensure_ascii=False) + '\n')
    return tmp_path


def test_committed_receipt_verifies_and_shows_the_contrasts(capsys):
    """The receipt CI verifies: 21 episodes, every check matched, and the three contrasts of the
    study as numbers."""
    res = verify_observed(REPORT)
    assert (res['status'], res['cases'], res['checks'] == res['matched']) == ('verified', 21, True)
    rc = json.loads((REPORT / 'receipt.json').read_text())
    r = lambda cid, side, k: _case(rc, cid)[side]['breakdown'][k]
    # a failed update/delete: maintenance only officially
    for cid in (
        'update_failed',
        'delete_failed',
        'update_never_added',
    ):
        assert (
            r(cid, 'official', 'memory_r_maintenance'),
            r(cid, 'observed', 'memory_r_maintenance'),
        ) == (1.0, 0.0), cid
    reset = _case(rc, 'stage1_add_removed')  # the reset Stage-1 add: visible only when observed
    assert (
        reset['official']['memory_stats']['added_count'],
        reset['observed']['memory_stats']['added_count'],
    ) == (0, 1)
    assert reset['store_held'] == ['mem-01'] and reset['difference']['total'] > 0
    prose = _case(rc, 'summary_prose_only')  # a tool named in prose: counts only officially
    assert (
        prose['official']['tool_stats']['Summary_context'],
        prose['observed']['tool_stats']['Summary_context'],
    ) == (1, 0)
    assert prose['difference']['total'] < 0
    fig = sha256_file(REPORT / 'differences.png')  # the README states the figure it shows
    assert render_report(rc, figure_sha256=fig) == (REPORT / 'README.md').read_text()
    assert (
        f'`differences.png` SHA-256 `{fig}`, drawn by `plot_differences` from this receipt.'
        in (REPORT / 'README.md').read_text()
    )
    assert (
        audit_cli(['--study', 'observed', '--verify']) == 0
        and '"verified"' in capsys.readouterr().out
    )


def test_judge_free_cases_are_also_scored_with_the_local_judge_on():
    """Every judge-free case records both rewards with the local judge on; only the memory component
    moves, and the README shows the table."""
    rc = json.loads((REPORT / 'receipt.json').read_text())
    free = [c for c in rc['cases'] if c['judge'] is None]
    assert (
        len(free) == 19
        and all(c['judge_on'] for c in free)
        and all(c['judge_on'] is None for c in rc['cases'] if c['judge'])
    )
    for c in free:
        for side in ('official', 'observed'):
            on, off = c['judge_on'][side]['breakdown'], c[side]['breakdown']
            assert all(
                on[k] == off[k]
                for k in ('task_completion', 'context_management', 'tool_efficiency')
            ), c['id']
    used, ignored = (
        _case(rc, 'retrieval_used')['judge_on'],
        _case(rc, 'retrieval_ignored')['judge_on'],
    )
    assert (
        used['observed']['breakdown']['memory_r_relevance'],
        ignored['observed']['breakdown']['memory_r_relevance'],
    ) == (1.0, 0.0)
    assert '## The judge on' in (REPORT / 'README.md').read_text()


def test_memagent_audit_is_the_command_for_both_studies(capsys):
    """The console script points at the command that takes --study; without it, the first study's
    verification runs unchanged."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / 'settings.ini')
    assert (
        'memagent-audit=memagent.observed.receipt:audit_cli'
        in cfg['DEFAULT']['console_scripts'].split()
    )
    assert audit_cli(['--verify']) == 0 and '"cases": 16' in capsys.readouterr().out


EDITS = [
    (
        'a failed update logged as a success',
        lambda rc: _case(rc, 'update_failed')['log'][1].update(result=True),
        "case 'update_failed': observed.memory_stats (from the log)",
    ),
    (
        'a log entry from no reply of the episode',
        lambda rc: _case(rc, 'delete_failed')['log'][1].update(issued_by='I deleted it.'),
        "case 'delete_failed': log entry 2 was issued by a reply that is not in the episode",
    ),
    (
        'an observed statistic',
        lambda rc: _case(rc, 'stage1_add_removed')['observed']['memory_stats'].update(
            added_count=0
        ),
        "case 'stage1_add_removed': observed.memory_stats (from the log)",
    ),
    (
        'a difference',
        lambda rc: _case(rc, 'summary_called')['difference'].update(total=0.5),
        "case 'summary_called': difference",
    ),
    (
        'an official total',
        lambda rc: _case(rc, 'judge_one')['official']['breakdown'].update(total=0.9),
        "case 'judge_one': difference",
    ),
    (
        'the context',
        lambda rc: _case(rc, 'retrieval_used')['context'].pop(),
        "case 'retrieval_used': context has",
    ),
    (
        'the store held',
        lambda rc: _case(rc, 'delete_succeeded').update(store_held=['mem-01']),
        "store_held (from the log)",
    ),
    (
        'the final answer',
        lambda rc: _case(rc, 'retrieval_ignored').update(final_answer='Kestrel Bay'),
        "retrieval_ignored",
    ),
    (
        'meaning',
        lambda rc: rc.update(meaning='passed = the observed reward is correct'),
        "meaning: stored 'passed = the observed",
    ),
    (
        'limits',
        lambda rc: rc.update(limits='A policy trained on it behaves better.'),
        'limits: stored',
    ),
    (
        'an added claim',
        lambda rc: rc.update(reviewed_by='an independent auditor'),
        'receipt.reviewed_by: not a field the runner writes',
    ),
    (
        'the embedder',
        lambda rc: rc['store']['embedder'].update(name='text-embedding-v4'),
        'store: stored',
    ),
    (
        'environment emptied',
        lambda rc: rc.update(environment={}),
        'environment {} is not what the runner writes',
    ),
    (
        'provenance dirty flipped',
        lambda rc: rc['provenance']['git'].update(dirty=True),
        'provenance.git: dirty=True',
    ),
    ('provenance removed', lambda rc: rc.pop('provenance'), 'receipt.provenance: missing'),
    (
        'a file hash',
        lambda rc: rc['audited']['files'].update({STORE_MODULE: '0' * 64}),
        'is not the pinned',
    ),
    (
        'the executed files',
        lambda rc: rc['audited'].update(executed=rc['audited']['executed'][:1]),
        'audited.executed: stored',
    ),
    ('a case removed', lambda rc: rc['cases'].pop(), "present 0 times in the receipt"),
    ('the summary', lambda rc: rc['summary'].update(matched=1), 'summary.matched: stored 1'),
    (
        'a check flag',
        lambda rc: _case(rc, 'update_succeeded')['checks'][0].update(match=False),
        'recorded checks disagree',
    ),
    (
        'a round marked collected',
        lambda rc: _case(rc, 'update_succeeded')['rounds'][0].update(collected=True, why='answer'),
        "case 'update_succeeded': 2 Stage-3 replies and finished_at_round 1, the recorded rounds "
        "say otherwise",
    ),
    (
        'a round dropped',
        lambda rc: _case(rc, 'delete_after_failed')['rounds'].pop(0),
        "case 'delete_after_failed': 3 Stage-3 replies",
    ),
    (
        'the corrections record',
        lambda rc: rc['corrections'].update(amended=0),
        'corrections: stored',
    ),
    (
        'a judge-on total',
        lambda rc: _case(rc, 'retrieval_used')['judge_on']['observed']['breakdown'].update(
            total=0.9
        ),
        "case 'retrieval_used': judge_on.difference",
    ),
    (
        'a judge-on task component',
        lambda rc: _case(rc, 'stage1_add_kept')['judge_on']['official']['breakdown'].update(
            tool_efficiency=0.2
        ),
        "case 'stage1_add_kept': judge_on.official.breakdown.tool_efficiency (judge off)",
    ),
    (
        'a judge-on statistic',
        lambda rc: _case(rc, 'no_user_message')['judge_on']['observed']['memory_stats'].update(
            added_count=2
        ),
        "case 'no_user_message': judge_on.observed.memory_stats (judge off)",
    ),
    (
        'a judge reply out of the rule',
        lambda rc: _case(rc, 'retrieval_ignored')['judge_on']['official']['judge_replies'][
            0
        ].update(reply='2'),
        "case 'retrieval_ignored': judge_on.official: judge reply",
    ),
    (
        'a judge call dropped',
        lambda rc: _case(rc, 'retrieval_used')['judge_on']['observed']['judge_replies'].pop(),
        "case 'retrieval_used': judge_on.observed: judge_calls 2 is not the number of "
        "judge_replies",
    ),
    (
        'the judge-on answer',
        lambda rc: _case(rc, 'retrieval_ignored')['judge_on'].update(answer='Kestrel Bay'),
        "case 'retrieval_ignored': judge_on.answer",
    ),
    (
        'judge-on removed',
        lambda rc: _case(rc, 'summary_called').update(judge_on=None),
        "case 'summary_called': judge_on must be recorded exactly when the episode runs no judge",
    ),
    (
        'judge-on added to a judged case',
        lambda rc: _case(rc, 'judge_one').update(
            judge_on=_case(rc, 'judge_zero')['judge_on'] or {}
        ),
        "case 'judge_one': judge_on must be",
    ),
]


@pytest.mark.parametrize('edit,message', [e[1:] for e in EDITS], ids=[e[0] for e in EDITS])
def test_an_edited_field_is_refused(tmp_path, edit, message, capsys):
    d = _copy(tmp_path, edit)
    with pytest.raises(VerificationError) as e:
        verify_observed(d)
    assert message in str(e.value), str(e.value)[:3000]
    assert (
        audit_cli(['--study', 'observed', '--verify', '--report-dir', str(d)]) == 1
        and 'VERIFY FAILED' in capsys.readouterr().err
    )


def test_an_edited_report_is_refused(tmp_path):
    "The README a reader sees with one figure changed: not the receipt's rendering."
    d = _copy(tmp_path)
    text = (d / 'README.md').read_text()
    (d / 'README.md').write_text(
        text.replace(
            '| `stage1_add_removed` | stage1_add | pair | 0.',
            '| `stage1_add_removed` | stage1_add | pair | 1.',
            1,
        )
    )
    assert (d / 'README.md').read_text() != text
    with pytest.raises(VerificationError) as e:
        verify_observed(d)
    assert (
        f'{d / "README.md"}: not the rendering of the receipt (memagent.observed.render_report): '
        'line ' in str(e.value)
    ), str(e.value)
    assert "reads '| `stage1_add_removed` | stage1_add | pair | 1." in str(
        e.value
    ) and 'differences.png' not in str(e.value)


def _png(width: int) -> bytes:
    "A valid PNG, `width` x 1 black pixels: another image than the committed figure."
    import struct, zlib

    chunk = lambda t, b: struct.pack('>I', len(b)) + t + b + struct.pack('>I', zlib.crc32(t + b))
    return (
        b'\x89PNG\r\n\x1a\n'
        + chunk(b'IHDR', struct.pack('>IIBBBBB', width, 1, 8, 0, 0, 0, 0))
        + chunk(b'IDAT', zlib.compress(b'\0' + b'\0' * width))
        + chunk(b'IEND', b'')
    )


@pytest.mark.parametrize(
    'swap', [lambda b: b + b'\0', lambda b: _png(8)], ids=['one byte appended', 'another image']
)
def test_a_swapped_figure_is_refused(tmp_path, swap, capsys):
    """differences.png replaced: its SHA-256 is not the one README.md states, and the message names
    the figure."""
    d = _copy(tmp_path)
    (d / 'differences.png').write_bytes(swap((REPORT / 'differences.png').read_bytes()))
    with pytest.raises(VerificationError) as e:
        verify_observed(d)
    want = (
        f"{d / 'differences.png'}: the figure's SHA-256 {sha256_file(d / 'differences.png')} is "
        f"not the one README.md states ({sha256_file(REPORT / 'differences.png')})"
    )
    assert want in str(e.value) and 'not the rendering' not in str(e.value), str(e.value)
    assert (
        audit_cli(['--study', 'observed', '--verify', '--report-dir', str(d)]) == 1
        and 'differences.png' in capsys.readouterr().err
    )


@pytest.mark.parametrize('name', ['README.md', 'differences.png'])
def test_a_missing_report_file_is_refused(tmp_path, name):
    "The report is README.md and the figure it shows: either one missing fails, naming it."
    d = _copy(tmp_path)
    (d / name).unlink()
    with pytest.raises(VerificationError) as e:
        verify_observed(d)
    assert f'{d / name}: missing' in str(e.value), str(e.value)


def test_episodes_edited_with_the_receipts_hash_of_them_are_refused(tmp_path):
    """An expectation changed in episodes.json and the receipt's hash updated to match: the hash
    pinned in the code still refuses it."""
    from memagent.provenance import sha256_file

    d = _copy(tmp_path)
    ep = json.loads((d / 'episodes.json').read_text())
    ep['cases'][1]['expect']['observed']['memory_r']['maintenance'] = 1.0
    (d / 'episodes.json').write_text(json.dumps(ep, indent=1) + '\n')
    rc = json.loads((d / 'receipt.json').read_text())
    rc['fixtures']['sha256'] = sha256_file(d / 'episodes.json')
    (d / 'receipt.json').write_text(json.dumps(rc, indent=1) + '\n')
    with pytest.raises(VerificationError) as e:
        verify_observed(d)
    assert f'is not the committed one pinned in memagent.observed ({EPISODES_SHA256})' in str(
        e.value
    )


def test_rounds_are_counted_as_the_workflow_collects_them():
    """finished_at_round is the number of Stage-3 rounds the workflow collects (collected_round),
    and the receipt shows each round."""
    from memagent.observed import collected_round

    rc = json.loads((REPORT / 'receipt.json').read_text())
    for c in rc['cases']:
        assert c['finished_at_round'] == sum(x['collected'] for x in c['rounds']), c['id']
    # two deletes, then the answer: one collected round
    for cid in (
        'delete_after_failed',
        'delete_after_cancelled',
    ):
        c = _case(rc, cid)
        assert [x['collected'] for x in c['rounds']] == [False, False, True] and c['difference'][
            'total'
        ] < 0, cid
    assert [x['collected'] for x in _case(rc, 'retrieval_used')['rounds']] == [True, True]
    assert (
        collected_round([{'name': 'Delete_memory', 'arguments': {}}], None, 0, 5, False, False)
        is None
    )
    assert (
        collected_round([{'name': 'Clear_context', 'arguments': {}}], None, 4, 5, False, False)
        is None
    )


def test_an_amendment_not_of_the_registered_value_is_refused(tmp_path):
    """corrections.json amends only the fields finished_at_round enters, from the value
    episodes.json registered; its hash is pinned."""
    from memagent.observed import load_corrections, load_episodes

    ep = load_episodes(REPORT / 'episodes.json')
    co = json.loads((REPORT / 'corrections.json').read_text())
    co['amended']['update_failed']['finished_at_round']['registered'] = 3
    (tmp_path / 'c.json').write_text(json.dumps(co))
    with pytest.raises(
        ValueError,
        match=(
            r"amended\['update_failed'\].finished_at_round: needs \"registered\" \(the "
            r"episodes.json value, 2\)"
        ),
    ):
        load_corrections(tmp_path / 'c.json', ep)
    co = json.loads((REPORT / 'corrections.json').read_text())
    co['amended']['update_failed']['observed.memory_r.maintenance'] = {
        'registered': 0.0,
        'corrected': 1.0,
    }
    (tmp_path / 'c.json').write_text(json.dumps(co))
    with pytest.raises(ValueError, match='not an amendable field'):
        load_corrections(tmp_path / 'c.json', ep)
    (tmp_path / 'r').mkdir()
    d = _copy(tmp_path / 'r')
    co = json.loads((d / 'corrections.json').read_text())
    co['amended']['update_failed']['finished_at_round']['corrected'] = 2
    (d / 'corrections.json').write_text(json.dumps(co, indent=1) + '\n')
    with pytest.raises(VerificationError, match='corrections.json SHA-256'):
        verify_observed(d)


WRONG_SHAPES = [
    ('a list', lambda rc: [rc], 'a JSON list, not the object a receipt is'),
    ('cases an object', lambda rc: {**rc, 'cases': {'a': 1}}, "cases: {'a': 1}, not a list"),
    (
        'a log that is a string',
        lambda rc: {**rc, 'cases': [{**rc['cases'][0], 'log': 'fine'}, *rc['cases'][1:]]},
        "case 'update_succeeded': log, context, official and observed must be",
    ),
    (
        'official a list',
        lambda rc: {**rc, 'cases': [{**rc['cases'][0], 'official': []}, *rc['cases'][1:]]},
        "case 'update_succeeded': log, context, official and observed must be",
    ),
    (
        'a log entry a number',
        lambda rc: {**rc, 'cases': [{**rc['cases'][0], 'log': [3]}, *rc['cases'][1:]]},
        'the receipt has the wrong shape',
    ),
]


@pytest.mark.parametrize(
    'make,message', [w[1:] for w in WRONG_SHAPES], ids=[w[0] for w in WRONG_SHAPES]
)
def test_a_receipt_of_the_wrong_shape_fails_verification_with_a_reason(
    tmp_path, make, message, capsys
):
    d = _copy(tmp_path, make=make)
    with pytest.raises(VerificationError) as e:
        verify_observed(d)
    assert message in str(e.value), str(e.value)[:2000]
    # not a receipt at all: bad input
    code, said = (2, 'REFUSED') if e.value.__dict__.get('bad_input') else (1, 'VERIFY FAILED')
    assert code == (2 if message.startswith('a JSON list') else 1)
    assert (
        audit_cli(['--study', 'observed', '--verify', '--report-dir', str(d)]) == code
        and said in capsys.readouterr().err
    )


def test_run_notebook_verify_mode(tmp_path):
    "The run notebook, as a user runs it in verify mode: the receipt verifies and its tables show."
    pm = pytest.importorskip('papermill')
    out = tmp_path / 'out.ipynb'
    pm.execute_notebook(
        str(ROOT / 'nbs' / 'agemem_observed.ipynb'),
        str(out),
        parameters={'mode': 'verify'},
        cwd=str(ROOT),
        progress_bar=False,
        kernel_name='python3',
    )
    nb = json.loads(out.read_text())
    text = ''.join(
        ''.join(o.get('text', '')) + json.dumps(o.get('data', {}))
        for c in nb['cells']
        for o in c.get('outputs', [])
    )
    assert (
        '"status": "verified"' in text
        and '`summary_prose_only`' in text
        and AUDITED_REVISION in text
    )


@needs_src
def test_full_run_reproduces_the_committed_cases(tmp_path):
    before = check_checkout(SRC, AUDITED_REVISION, OBSERVED_FILES)
    fresh = run_observed(SRC, REPORT)
    committed = json.loads((REPORT / 'receipt.json').read_text())
    assert fresh['status'] == 'passed'
    for k in ('cases', 'summary', 'fixtures', 'protocol', 'store', 'call_site_weights', 'audited'):
        assert fresh[k] == committed[k], k
    assert check_checkout(SRC, AUDITED_REVISION, OBSERVED_FILES) == before


@needs_src
def test_modified_store_in_the_checkout_is_refused_before_any_write(tmp_path):
    clone = tmp_path / 'AgeMem'
    subprocess.run(['git', 'clone', '-q', '--no-checkout', SRC, str(clone)], check=True)
    subprocess.run(['git', '-C', str(clone), 'checkout', '-q', AUDITED_REVISION], check=True)
    p = clone / STORE_MODULE
    p.write_text(
        p.read_text().replace(
            'if item is None:\n                return False',
            'if item is None:\n                return True',
            1,
        )
    )
    with pytest.raises(AuditRefused, match='SHA-256'):
        check_checkout(clone, AUDITED_REVISION, OBSERVED_FILES)
    assert (
        audit_cli(
            ['--study', 'observed', '--source-repo', str(clone), '--out', str(tmp_path / 'r.json')]
        )
        == 2
    )
    assert not (tmp_path / 'r.json').exists()


@needs_src
def test_a_run_into_the_report_folder_renders_its_figure_and_readme(tmp_path):
    """`memagent-audit --study observed --source-repo` writing the report folder's receipt draws the
    figure and writes the README."""
    d = _copy(tmp_path)
    for f in ('README.md', 'differences.png'):
        (d / f).unlink()
    assert audit_cli(['--study', 'observed', '--source-repo', SRC, '--report-dir', str(d)]) == 0
    assert (d / 'differences.png').is_file() and (d / 'README.md').is_file()
    from memagent.observed import verify_observed

    assert verify_observed(d)['status'] == 'verified'


class _ScriptedModel:
    """The model as `_run_stage3_formal_qa` uses it (lines 701-707): `chat_async` returns the
    episode's next reply; each call leaves
        one experience in the history, which `extract_experience_from_history` hands over and
        clears."""

    def __init__(self, steps):
        self.steps, self.history, self.step = list(steps), [], None

    async def chat_async(self, messages, n=1):
        if not self.steps:
            raise AssertionError(
                'the loop asked for a reply after the episode\'s last Stage-3 reply'
            )
        self.step = self.steps.pop(0)
        self.history.append(type('Exp', (), {'eid': type('EID', (), {'step': None})()})())
        return [type('Response', (), {'response_text': self.step['assistant']})()]

    def extract_experience_from_history(self, clear_history=True):
        out = self.history
        if clear_history:
            self.history = []
        return out


class _EpisodeChat:
    """The chat client `_apply_tools` asks for a summary (line 182): the summary the episode's
    current step gives; no other question."""

    def __init__(self, model):
        self.model = model

    def chat(self, messages, model_name=None, **kwargs):
        step = self.model.step or {}
        if 'summary' not in step:
            raise AssertionError(
                f'the workflow asked its chat client, and the step gives no summary: {step}'
            )
        return step['summary']


def _upstream_workflow(src):
    """train_hotpotQA.py loaded by path from the checked checkout, its imports the checkout's own
    modules or, where not installed, stand-ins."""
    import logging, types
    from memagent.audit import load_by_path
    from memagent.advantages.upstream import load_study
    from memagent.observed.store import WORKFLOW_FILE

    mods, pkg = load_study(src), 'trinity.common.workflows.memory_context'

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    registry = type('Registry', (), {'register_module': lambda self, name: lambda cls: cls})()
    stand_ins = {
        'trinity.common.experience': mods['experience'],
        'trinity.common.models.model': module(
            'trinity.common.models.model', ModelWrapper=type('ModelWrapper', (), {})
        ),
        'trinity.common.workflows.workflow': module(
            'trinity.common.workflows.workflow',
            WORKFLOWS=registry,
            Task=type('Task', (), {}),
            MultiTurnWorkflow=type('MultiTurnWorkflow', (), {}),
        ),
        'trinity.utils.log': module(
            'trinity.utils.log', get_logger=lambda name=None: logging.getLogger(name)
        ),
        f'{pkg}.memory_store': mods['store'],
        f'{pkg}.workflow_prompt': mods['workflow_prompt'],
        f'{pkg}.utils': mods['utils'],
        f'{pkg}.workflow_metrics': mods['workflow_metrics'],
        'trinity.common.workflows.memory_reward.my_reward': mods['reward'],
    }
    return load_by_path(src, WORKFLOW_FILE, f'{pkg}.train_hotpotQA', stand_ins), mods


@needs_src
def test_finished_at_round_is_what_upstreams_stage3_loop_collects():
    """Upstream's own `_run_stage3_formal_qa` (train_hotpotQA.py lines 676-775), run on each
    episode's Stage-3 replies after its
        earlier stages' tool calls ran through upstream's `_apply_tools`, collects as many
        experiences
        as the receipt's `finished_at_round`,
        asks for exactly the episode's replies, and leaves the context the receipt records (an
        episode
        with no Stage-3 user message: less
        the question the loop asks itself)."""
    import asyncio, itertools, logging, types
    from memagent.observed.store import load_episodes, make_manager

    wf, mods = _upstream_workflow(SRC)
    W = wf.AgeMemHotpotWorkflowTraining
    ep, rc = (
        load_episodes(REPORT / 'episodes.json'),
        json.loads((REPORT / 'receipt.json').read_text()),
    )
    for case in ep['cases']:
        ids = itertools.count(1)
        # the recorder's ids for the store's adds (line 277)
        wf.uuid = types.SimpleNamespace(uuid4=lambda: f'mem-{next(ids):02d}')
        # __init__ builds a hosted client; the loop reads only what is set here
        self = object.__new__(W)
        self.model = model = _ScriptedModel([])
        self.chat_client, self.memory_manager = _EpisodeChat(model), make_manager(mods['store'], [])
        self.context_messages, self.verbose, self.logger, self.expected_answer = (
            [],
            False,
            logging.getLogger('agemem'),
            None,
        )
        self.max_context_tokens, self.auto_summary_token_threshold = case['call']['max_tokens'], 0.8
        self.stage3_max_rounds, self.current_stage = case['call']['max_rounds'], 0
        stage3 = []
        for s in case['steps']:
            if 'stage' in s:
                if self.current_stage == 0 or s['stage'] == 2:
                    self.context_messages.clear()
                    self._append_context('system', ep['system_prompt'])
                self.current_stage = s['stage']
            elif self.current_stage == 3:
                stage3.append(s)
            elif 'user' in s:
                self._append_context('user', s['user'])
            else:
                model.step = s
                self._append_context('assistant', s['assistant'])
                self._apply_tools(wf.parse_tool_calls(s['assistant']))
        users = [s['user'] for s in stage3 if 'user' in s]
        assert len(users) <= 1 and all('user' not in s for s in stage3[1:]), case['id']
        # the loop asks the question itself (line 685)
        self.question = users[0] if users else case['call']['question']
        model.steps = [s for s in stage3 if 'assistant' in s]
        exps, task_score, found = asyncio.run(W._run_stage3_formal_qa(self))
        assert model.steps == [], f"{case['id']}: the loop ended before the episode's last reply"
        assert len(exps) == _case(rc, case['id'])['finished_at_round'], case['id']
        assert found == _case(rc, case['id'])['found_answer'], case['id']
        ctx = (
            self.context_messages
            if users
            else [
                m for m in self.context_messages if m != {'role': 'user', 'content': self.question}
            ]
        )
        # and the recorder's context is upstream's (less the question it asks itself)
        assert ctx == _case(rc, case['id'])['context'], case['id']
