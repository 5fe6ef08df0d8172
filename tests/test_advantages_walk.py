"""The third study's walk on the pinned checkout: experiences per stage, the Stage-2 reset, the
loops' ends, lost episodes,
both schedulers, and the behaviours read from the log. Skipped without the checkout (AGEMEM_SRC)."""

import os
import pytest

SRC = os.environ.get('AGEMEM_SRC')
pytestmark = pytest.mark.skipif(
    not SRC, reason='AGEMEM_SRC (the pinned upstream checkout) is not set'
)

TASK = {
    'task_id': '0/test',
    'question': 'Which harbour did Ilse Marrow leave for her first coastal survey?',
    'answer': 'Kestrel Bay',
    'context': {
        'title': ['Ilse Marrow', 'Gull Point Light'],
        'sentences': [
            [
                'Ilse Marrow was a coastal surveyor.',
                ' She left Kestrel Bay for her first coastal survey in 1851.',
            ],
            ['Gull Point Light is a lighthouse on the same coast.', ' It was first lit in 1860.'],
        ],
    },
    'supporting_facts': None,
}
MEMORY = 'Ilse Marrow left Kestrel Bay for her first coastal survey.'
S1 = (
    '<think>Important note to remember for later: where the first survey '
    'began.</think><tool_call>[{"name": "Add_memory", "arguments": {"content": "'
    + MEMORY
    + '", "memory_type": "fact"}}]</tool_call><think>Stored.</think><answer>Noted.</answer>'
)
S2 = '<think>This is off topic.</think><answer>Let us return to the survey later.</answer>'
RIGHT = '<think>The survey began at Kestrel Bay.</think><answer>Kestrel Bay</answer>'
WRONG = '<think>The survey began at Gull Point.</think><answer>Gull Point</answer>'
UNSURE = '<think>I am not sure where the survey began.</think>'
PLAIN = '<think>Let me recall the survey.</think>'
RETRIEVE = (
    '<think>I should check my notes.</think><tool_call>[{"name": "Retrieve_memory", "arguments": '
    '{"query": "Ilse Marrow first coastal survey harbour"}}]</tool_call>'
)
NAMED = '<think>I could use Retrieve_memory to check my notes.</think>'


def UPDATE(mid):
    return (
        '<think>Record the year as well.</think><tool_call>[{"name": "Update_memory", '
        '"arguments": {"memory_id": "'
        + mid
        + (
            '", "content": "Ilse Marrow left Kestrel Bay for her first coastal survey in '
            '1851."}}]</tool_call>'
        )
    )


UPDATE_NAMED = '<think>I should Update_memory mem-01 with the year 1851.</think>'
SUMMARY = (
    '<think>The context should stay short.</think><tool_call>[{"name": "Summary_context", '
    '"arguments": {"span": "all", "preserve_user_query": '
    'true}}]</tool_call><think>Done.</think><answer>Let us return to the survey later.</answer>'
)
SUMMARY_NAMED = (
    '<think>I could call Summary_context to keep the context short.</think><answer>Let us return '
    'to the survey later.</answer>'
)
S1_EMPTY = S1.replace('"content": "' + MEMORY + '"', '"content": ""')
S1_NO_ANSWER = S1.replace(
    '"content": "' + MEMORY + '"',
    '"content": "Ilse Marrow\'s first coastal survey began from a harbour in 1851."',
)
BASE = [S1, S2, S2, S2]


@pytest.fixture(scope='module')
def env():
    from memagent.advantages.upstream import load_study
    from memagent.models import load_tokenizer

    return load_study(SRC), load_tokenizer('smollm2-135m-instruct')


def run(env, episodes, scheduler='sync', all_used=True, **kw):
    from memagent.advantages.walk import ScriptedEngine, play

    mods, tok = env
    eng = ScriptedEngine({TASK['task_id']: episodes}, tok)
    recs = play(mods, [TASK], len(episodes), eng, tok, scheduler=scheduler, **kw)
    if all_used:
        assert eng.unused() == []
    return recs


def where(rec):
    return [(x['stage'], x['distractor'], x['round']) for x in rec['experiences']]


def test_base_episode_collects_one_three_one(env):
    b1, b2, b3, b4 = run(
        env, [BASE + [RIGHT], BASE + [WRONG], BASE + [UNSURE] * 5, BASE + [PLAIN, RIGHT]]
    )
    assert where(b1) == [(1, None, 0), (2, 0, 0), (2, 1, 0), (2, 2, 0), (3, None, 0)]
    assert [x['why'] for x in b1['experiences']] == [
        'memory tool before the last round (lines 544-551)'
    ] + ['answer (lines 653-658)'] * 3 + ['answer (lines 752-758)']
    assert (b1['finished_at_round'], b1['found_answer'], b1['final_answer'], b1['task_score']) == (
        1,
        True,
        'Kestrel Bay',
        1.0,
    )
    assert (b2['finished_at_round'], b2['final_answer'], b2['task_score']) == (1, 'Gull Point', 0.0)
    # only the fifth UNSURE round
    assert where(b3)[-1:] == [(3, None, 4)] and len(b3['experiences']) == 5
    assert b3['experiences'][-1]['why'] == 'last round, no answer (lines 767-771)'
    assert (b3['finished_at_round'], b3['found_answer'], b3['final_answer'], b3['task_score']) == (
        1,
        False,
        None,
        0.0,
    )
    # the PLAIN round is not collected
    assert where(b4)[-1:] == [(3, None, 1)] and len(b4['experiences']) == 5
    assert [r['stage'] for r in b4['replies']] == [1, 2, 2, 2, 3, 3]
    assert all(r['lost'] is None and not r['window_break'] for r in (b1, b2, b3, b4))


def test_retrieval_round_is_collected_in_advance_in_stage_3(env):
    a, b = run(env, [BASE + [RETRIEVE, RIGHT], BASE + [NAMED, RIGHT]])
    assert len(a['experiences']) == 6 and a['finished_at_round'] == 2
    assert a['experiences'][4] == {
        'stage': 3,
        'distractor': None,
        'round': 0,
        'why': 'context tool before the last round (lines 739-746)',
    }
    assert len(b['experiences']) == 5 and b['finished_at_round'] == 1
    # Stage 1's memory, after the reset
    assert [x['memory_id'] for x in a['log'][-1]['result']] == ['mem-01']


def test_stage_2_reset_keeps_the_store(env):
    (rec,) = run(env, [BASE + [RIGHT]])
    mods, _ = env
    from memagent.advantages.upstream import system_prompt, distractor_messages

    ctx = rec['context']
    assert (
        ctx[0] == {'role': 'system', 'content': system_prompt(mods)}
        and sum(m['role'] == 'system' for m in ctx) == 1
    )
    assert ctx[1] == {'role': 'user', 'content': distractor_messages(mods, TASK['question'], 3)[0]}
    assert not any('Gull Point Light' in m['content'] or m['content'] == S1 for m in ctx)
    assert [m['role'] for m in ctx] == ['system'] + ['user', 'assistant'] * 4
    assert (rec['log'][0]['stage'], rec['log'][0]['result'], rec['log'][-1]['store_after']) == (
        1,
        {'memory_id': 'mem-01', 'stored': True},
        ['mem-01'],
    )


def test_loops_end_after_five_rounds_and_collect_their_last(env):
    (rec,) = run(
        env,
        [
            [PLAIN] * 4
            + [S1.replace('<answer>Noted.</answer>', '')]
            + [PLAIN] * 5
            + [S2, S2]
            + [UNSURE] * 5
        ],
    )
    stage1 = [x for x in rec['experiences'] if x['stage'] == 1]
    # an add in the last round
    assert stage1 == [
        {'stage': 1, 'distractor': None, 'round': 4, 'why': 'last round, no answer (lines 571-574)'}
    ]
    assert [x for x in rec['experiences'] if x['stage'] == 2][0] == {
        'stage': 2,
        'distractor': 0,
        'round': 4,
        'why': 'last round, no answer (lines 667-670)',
    }
    assert [(r['stage'], r['distractor'], r['round']) for r in rec['replies']][4:7] == [
        (1, None, 4),
        (2, 0, 0),
        (2, 0, 1),
    ]
    assert len(rec['replies']) == 5 + 5 + 2 + 5 and len(rec['experiences']) == 1 + 3 + 1


def test_overflow_ends_the_loop_and_is_collected(env):
    # 26,600 characters: over 0.8 x 8192 x 4 with the system prompt
    long = '<think>' + 'survey ' * 3800 + '</think>'
    (rec,) = run(env, [[long] + [S2] * 3 + [RIGHT]])
    assert rec['experiences'][0] == {
        'stage': 1,
        'distractor': None,
        'round': 0,
        'why': 'automatic summary (lines 565-569)',
    }
    assert [r['stage'] for r in rec['replies']] == [1, 2, 2, 2, 3] and len(rec['experiences']) == 5


def test_summary_in_a_distractor_loop(env):
    a, b = run(env, [[S1, SUMMARY, S2, S2, RIGHT], [S1, SUMMARY_NAMED, S2, S2, RIGHT]])
    assert a['experiences'][1] == {
        'stage': 2,
        'distractor': 0,
        'round': 0,
        'why': 'context tool before the last round (lines 640-647)',
    }
    assert a['log'][1]['tool'] == 'Summary_context' and a['log'][1]['result'] == {'summarized': 1}
    assert a['context'][2] == {
        'role': 'tool',
        'content': (
            '[summary of 1 messages]\nSummary of 1 earlier messages: 0 user, 1 assistant, 0 tool.'
        ),
    }
    assert (
        len(a['experiences']) == len(b['experiences']) == 5
        and b['experiences'][1]['why'] == 'answer (lines 653-658)'
    )


def test_a_call_upstream_cannot_dispatch_loses_only_its_episode(env):
    not_object = '<tool_call>["Add_memory"]</tool_call>'
    bad_args = '<tool_call>[{"name": "Add_memory", "arguments": "Kestrel Bay"}]</tool_call>'
    bad_top_k = (
        '<tool_call>[{"name": "Retrieve_memory", "arguments": {"query": "survey", "top_k": '
        '"many"}}]</tool_call>'
    )
    ok, a, b, c = run(env, [BASE + [RIGHT], [not_object], [S1, bad_args], BASE + [bad_top_k]])
    assert ok['lost'] is None and len(ok['experiences']) == 5
    assert 'is not an object' in a['lost'] and a['lost'].startswith('reply 0 (stage 1, round 0)')
    assert (a['log'], a['experiences'], a['context'][-1]) == (
        [],
        [],
        {'role': 'assistant', 'content': not_object},
    )
    assert (
        'is not an object with an object of arguments' in b['lost'] and len(b['experiences']) == 1
    )
    assert (
        c['lost'].startswith('reply 4 (stage 3, round 0): ValueError')
        and c['finished_at_round'] == 0
    )
    assert c['task_score'] is None


def test_an_engine_error_loses_the_episode(env):
    (rec,) = run(env, [BASE])  # the script ends before Stage 3
    assert rec['lost'].startswith(
        'reply 4 (stage 3, round 0): DeterministicEngineError: no scripted reply'
    )


def test_run_sync_and_run_async_give_the_same_records(env):
    from memagent.advantages.walk import AgeMemWalk, ScriptedEngine
    from memagent.rollout import run_async

    episodes = [
        BASE + [RIGHT],
        BASE + [WRONG],
        BASE + [UNSURE] * 5,
        BASE + [PLAIN, RIGHT],
        BASE + [RETRIEVE, RIGHT],
        [S1_EMPTY] + BASE[1:] + [RETRIEVE, WRONG],
        [S1, SUMMARY, S2, S2, UNSURE] + [UNSURE] * 4,
        [S1, S2, S2, S2, UPDATE('mem-07') + RIGHT],
    ]
    sync = run(env, episodes, 'sync')
    assert sync == run(env, episodes, 'async')
    mods, tok = env
    walk = AgeMemWalk(mods, [TASK], 8, tok)
    assert [walk.turns_left(j) for j in range(8)] == [25] * 8
    with pytest.raises(ValueError, match='is not finished'):
        walk.records()
    groups = []
    run_async(
        walk,
        ScriptedEngine({TASK['task_id']: episodes}, tok).request_queue(),
        on_group=groups.append,
    )
    assert (
        walk.records() == sync
        and [walk.turns_left(j) for j in range(8)] == [0] * 8
        and len(groups) == 1
        and len(groups[0]) == 8
    )


def test_behaviours(env):
    from memagent.advantages.walk import behaviours

    mods, _ = env
    delete = lambda mid, ok: (
        '<tool_call>[{"name": "Delete_memory", "arguments": {"memory_id": "'
        + mid
        + '", "confirmation": '
        + ok
        + '}}]</tool_call>'
    )
    # a name that is no tool
    episodes = [
        BASE + [RIGHT],
        BASE + [RETRIEVE, RIGHT],
        BASE + [NAMED, RIGHT],
        BASE + [UPDATE('mem-01') + RIGHT],
        BASE + [UPDATE('mem-07') + RIGHT],
        BASE + [UPDATE_NAMED + RIGHT],
        [S1_EMPTY] + BASE[1:] + [RETRIEVE, WRONG],
        [S1_NO_ANSWER] + BASE[1:] + [RETRIEVE, RIGHT],
        [S1, SUMMARY, S2, S2, RIGHT],
        [S1, SUMMARY_NAMED, S2, S2, UNSURE] + [UNSURE] * 4,
        BASE
        + [delete('mem-01', 'false'), delete('mem-01', 'true'), delete('mem-01', 'true'), RIGHT],
        BASE + ['<tool_call>[{"name": ["Add_memory"], "arguments": {}}]</tool_call>' + RIGHT],
    ]
    got = [behaviours(r, TASK['answer'], mods) for r in run(env, episodes)]
    end = ['answered', 'correct']
    assert got[0] == ['call:Add_memory', 'add_content'] + end
    assert (
        got[1] == ['call:Retrieve_memory', 'call:Add_memory', 'add_content', 'retrieval_used'] + end
    )
    assert got[2] == ['call:Add_memory', 'prose:Retrieve_memory', 'add_content'] + end
    assert got[3] == ['call:Add_memory', 'call:Update_memory', 'update_ok', 'add_content'] + end
    assert got[4] == ['call:Add_memory', 'call:Update_memory', 'update_failed', 'add_content'] + end
    assert got[5] == ['call:Add_memory', 'prose:Update_memory', 'add_content'] + end
    assert got[6] == [
        'call:Retrieve_memory',
        'call:Add_memory',
        'add_empty',
        'retrieval_empty',
        'answered',
    ]
    assert (
        got[7]
        == ['call:Retrieve_memory', 'call:Add_memory', 'add_content', 'retrieval_ignored'] + end
    )
    assert (
        got[8]
        == ['call:Summary_context', 'call:Add_memory', 'add_content', 'summary_executed'] + end
    )
    assert got[9] == ['call:Add_memory', 'prose:Summary_context', 'add_content']
    assert (
        got[10]
        == [
            'call:Add_memory',
            'call:Delete_memory',
            'add_content',
            'delete_ok',
            'delete_failed',
            'delete_cancelled',
        ]
        + end
    )
    # no effect; named, not called
    assert got[11] == ['call:Add_memory', 'prose:Add_memory', 'add_content'] + end
    bad = dict(run(env, [BASE + [RIGHT]])[0], task_score=0.0)
    with pytest.raises(ValueError, match='task score 0.0 recorded, 1.0 recomputed'):
        behaviours(bad, TASK['answer'], mods)


def test_window_rule(env):
    from memagent.advantages.walk import AgeMemWalk, behaviours

    mods, tok = env
    (none,) = run(env, [[]], window=300)
    assert (none['replies'], none['experiences'], none['window_break'], none['task_score']) == (
        [],
        [],
        True,
        0.0,
    )
    assert behaviours(none, TASK['answer'], mods) == ['window_break']
    # Stage 1's prompt: one token too many
    first = len(AgeMemWalk(mods, [TASK], 1, tok).next_request(0)[1])
    (rec,) = run(env, [[S2] * 3 + [RIGHT] * 5], all_used=False, window=first + 256 - 1)
    assert (
        rec['window_break']
        and rec['replies'][0]['stage'] == 2
        and all(x['stage'] != 1 for x in rec['experiences'])
    )
