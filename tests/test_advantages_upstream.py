"""The third AgeMem study's upstream parts: the pins are the protocol's, and the local judge,
summariser and similarity model follow
the protocol's rules. With an upstream checkout at $AGEMEM_SRC: a checkout with a changed file is
refused before anything loads; the
load leaves no module behind; the task score is upstream's exact match; the two rewards of a minimal
record differ where the second
study says they do; and upstream's GRPO gives the advantages worked by hand, with per-experience and
per-episode advantages in the
ratio sqrt((8n - 1) / (7n)) when every episode collects n experiences."""

import math, os, re, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memagent.audit import AUDITED_REVISION, AuditRefused
from memagent.observed.store import OBSERVED_FILES, Recorder
from memagent.advantages.upstream import (
    ADVANTAGE_FILES,
    EXECUTED,
    GRPO_MODULE,
    SETTINGS,
    WEIGHTS,
    episode_rewards,
    grpo_advantages,
    load_study,
    similarity,
    stage1_message,
    summarise,
    system_prompt,
    task_score,
)
from memagent.observed.store import LocalJudge, contains_answer, judge_items

SRC = os.environ.get('AGEMEM_SRC')
needs_src = pytest.mark.skipif(
    not (SRC and Path(SRC).is_dir()),
    reason='AGEMEM_SRC is not set to an upstream AgeMem checkout '
    'at the pinned revision; the tests that load it are skipped',
)
QUESTION, ANSWER = (
    'Which harbour did Ilse Marrow leave for her first coastal survey?',
    'Kestrel Bay',
)
CONTEXT = {
    'title': ['Ilse Marrow', 'Gull Point Light'],
    'sentences': [
        [
            'Ilse Marrow was a coastal surveyor.',
            ' She left Kestrel Bay for her first coastal survey in 1851.',
        ],
        ['Gull Point Light is a lighthouse on the same coast.', ' It was first lit in 1860.'],
    ],
}


@pytest.fixture(scope='module')
def mods():
    return load_study(SRC)


def test_the_pins_are_the_protocols():
    text = (ROOT / 'reports' / 'agemem_advantages' / 'protocol.md').read_text()
    rows = re.findall(r'^\| `([^`]+)` \| `([0-9a-f]{64})` \| (\w+)', text, re.M)
    assert ADVANTAGE_FILES == {p: sha for p, sha, use in rows} and len(rows) == 13
    assert set(EXECUTED) == {p for p, sha, use in rows if use == 'executed'}
    assert all(ADVANTAGE_FILES[k] == v for k, v in OBSERVED_FILES.items())
    assert (
        SETTINGS['max_context_tokens'],
        SETTINGS['max_rounds'],
        SETTINGS['distractors'],
        SETTINGS['group_size'],
    ) == (8192, 5, 3, 8)
    assert list(WEIGHTS.values()) == [0.5, 0.2, 0.15, 0.15]


def test_the_local_judge_replies_on_the_two_prompt_shapes():
    j = LocalJudge(ANSWER)
    rel = (
        f'Grade.\nQuestion: {QUESTION}\nItems:\n- She left kestrel bay. (Memory ID: mem-01)\n- '
        'Gull Point\n\nOne number.'
    )
    assert j.chat([{'role': 'user', 'content': rel}]) == '1'
    # not a whole phrase
    assert (
        j.chat([{'role': 'user', 'content': rel.replace('kestrel bay', 'Kestrel Bayside')}]) == '0'
    )
    sto = (
        f'Grade.\nQuestion: {QUESTION}\nFacts:\n- Kestrel Bay\n\nEntries (3 total):\n1. Kestrel '
        'Bay.\n2. Gull Point\n3. from KESTREL BAY\n\nOne integer.'
    )
    assert judge_items(sto) == ('storage', ['Kestrel Bay.', 'Gull Point', 'from KESTREL BAY'])
    assert j.chat([{'role': 'user', 'content': sto}]) == '2'
    with pytest.raises(ValueError, match='neither of the two prompts'):
        judge_items(sto.replace('(3 total)', '(4 total)'))
    assert [c['reply'] for c in j.calls] == ['1', '0', '2']
    assert (
        contains_answer('(Kestrel Bay)', ANSWER)
        and not contains_answer('xKestrel Bay', ANSWER)
        and not contains_answer('x', '')
    )


def test_the_summariser_and_the_similarity_model():
    msgs = [
        {'role': 'user', 'content': 'u'},
        {'role': 'assistant', 'content': 'a'},
        {'role': 'tool', 'content': 't'},
        {'role': 'tool', 'content': 't'},
    ]
    assert summarise(msgs) == 'Summary of 4 earlier messages: 1 user, 1 assistant, 2 tool.'
    assert (
        similarity(' Chocolate CAKE ', {'role': 'user', 'content': 'a recipe for chocolate cake?'})
        == '1.0'
    )
    assert similarity('weather', 'a recipe') == '0.0'


@needs_src
def test_a_checkout_with_a_changed_file_is_refused(tmp_path):
    clone = tmp_path / 'AgeMem'
    subprocess.run(['git', 'clone', '-q', '--no-checkout', SRC, str(clone)], check=True)
    subprocess.run(['git', '-C', str(clone), 'checkout', '-q', AUDITED_REVISION], check=True)
    p = clone / GRPO_MODULE
    p.write_text(
        p.read_text().replace(
            'group_reward_std = torch.std(rewards)',
            'group_reward_std = torch.std(rewards, unbiased=False)',
            1,
        )
    )
    with pytest.raises(AuditRefused, match=f'{GRPO_MODULE}: SHA-256'):
        load_study(clone)


@needs_src
def test_the_load_leaves_no_module_and_no_bytecode(mods):
    caches = lambda: set(Path(SRC).rglob('__pycache__'))
    before = caches()
    load_study(SRC)
    assert caches() == before
    assert not any(
        m.startswith(('_agemem_advantages', 'trinity', 'verl', 'datasets')) for m in sys.modules
    )
    assert mods['revision'] == AUDITED_REVISION and set(mods['checkout']['files']) == set(
        ADVANTAGE_FILES
    )
    assert len(system_prompt(mods)) == 7224
    assert (
        stage1_message(mods, CONTEXT).startswith(mods['stage1_lead'])
        and stage1_message(mods, {'title': [], 'sentences': []}) is None
    )


@needs_src
def test_the_task_score_is_upstreams_exact_match(mods):
    assert [
        task_score(mods, a, ANSWER)
        for a in ('Kestrel Bay', ' kestrel bay', 'Answer: Kestrel Bay', 'Kestrel', None, '')
    ] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


@needs_src
def test_the_judge_answers_the_pinned_calculators_prompts(mods):
    calc = mods['reward'].ThreeStageRewardCalculator(**WEIGHTS, chat_client=LocalJudge(ANSWER))
    msgs = [
        {
            'role': 'assistant',
            'content': (
                '<tool_call>[{"name": "Add_memory", "arguments": {"content": "Gull Point, '
                '1860."}}]</tool_call>'
            ),
        },
        {
            'role': 'tool',
            'content': '[retrieved memories]\n- Gull Point, 1860. (Memory ID: mem-01)',
        },
    ]
    term, parts = calc._memory_quality(
        {'added_count': 1, 'retrieved_count': 1}, QUESTION, None, msgs
    )
    assert (parts['r_relevance'], parts['r_storage']) == (0.0, 0.0)
    assert [(c['kind'], c['items'], c['reply']) for c in calc.chat_client.calls] == [
        ('relevance', 1, '0'),
        ('storage', 1, '0'),
    ]


@needs_src
def test_the_rewards_of_a_minimal_record(mods):
    task = {'question': QUESTION, 'answer': ANSWER, 'supporting_facts': None}
    r = Recorder(mods, system_prompt(mods), where='test')
    r.enter(1)
    r.user(stage1_message(mods, CONTEXT))
    r.assistant(
        '<think>Important note to remember for later.</think><tool_call>[{"name": "Add_memory", '
        '"arguments": {"content": "Ilse Marrow left Kestrel Bay for her first coastal survey.", '
        '"memory_type": "fact"}}]</tool_call><answer>Noted.</answer>'
    )
    r.enter(2)
    r.enter(3)
    r.user(QUESTION)
    r.assistant('<answer>Kestrel Bay</answer>')
    rec = {
        'context': r.context,
        'log': r.log,
        'final_answer': ANSWER,
        'found_answer': True,
        'finished_at_round': 1,
        'task_score': task_score(mods, ANSWER, ANSWER),
    }
    off, on = episode_rewards(mods, rec, task, False), episode_rewards(mods, rec, task, True)
    for rw in (off, on):
        for side in rw.values():
            assert {
                'total',
                'breakdown',
                'tool_stats',
                'memory_stats',
                'context_stats',
                'judge_calls',
            } <= set(side)
            assert side['total'] == side['breakdown']['total']
    assert (
        off['official']['tool_stats']['Add_memory'] == 0
        and off['observed']['tool_stats']['Add_memory'] == 1
    )
    assert off['observed']['total'] - off['official']['total'] == pytest.approx(
        0.015 + 0.06, abs=1e-12
    )
    assert (
        on['observed']['breakdown']['memory_r_storage'] == 1.0
        and on['observed']['judge_calls'] == 1
    )
    assert (
        on['official']['total'] == off['official']['total'] and on['official']['judge_calls'] == 0
    )


@needs_src
def test_advantages_of_a_hand_worked_group(mods):
    # rewards 0.9, 0.1, 0.2 with 1, 2, 1 experiences: per experience the rewards are 0.9, 0.1, 0.1,
    # 0.2
    m4, m3 = (0.9 + 0.1 + 0.1 + 0.2) / 4, (0.9 + 0.1 + 0.2) / 3
    s4 = math.sqrt(((0.9 - m4) ** 2 + 2 * (0.1 - m4) ** 2 + (0.2 - m4) ** 2) / 3)
    s3 = math.sqrt(((0.9 - m3) ** 2 + (0.1 - m3) ** 2 + (0.2 - m3) ** 2) / 2)
    adv = grpo_advantages(mods, [0.9, 0.1, 0.2], [1, 2, 1], '0/C1')
    assert adv['per_experience'] == pytest.approx(
        [(x - m4) / (s4 + 1e-6) for x in (0.9, 0.1, 0.2)], abs=1e-6
    )
    assert adv['per_episode'] == pytest.approx(
        [(x - m3) / (s3 + 1e-6) for x in (0.9, 0.1, 0.2)], abs=1e-6
    )
    assert grpo_advantages(mods, [0.4], [3], '0/C1') == {
        'per_experience': [0.0],
        'per_episode': [pytest.approx(0.4 / (1 + 1e-6))],
    }
    with pytest.raises(ValueError, match='batch/task'):
        grpo_advantages(mods, [0.4], [1], 'C1')


@needs_src
@pytest.mark.parametrize('n', [5, 6])
def test_per_experience_is_per_episode_times_the_count_factor(mods, n):
    totals = [0.62, 0.12, -0.88, 0.61, 0.66, 0.16, -0.84, 0.65]
    adv = grpo_advantages(mods, totals, [n] * 8, '0/C3')
    for a, b in zip(adv['per_experience'], adv['per_episode']):
        assert a / b == pytest.approx(math.sqrt((8 * n - 1) / (7 * n)), rel=1e-4)
