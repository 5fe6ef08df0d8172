"""Pass@N screening: selection rules on hand-worked counts, refusal when too few qualify, and the
files screen writes."""

import json, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from memagent.screening import (
    select_screened,
    classify_counts,
    screen,
    ScreeningError,
    MANIFEST,
    NOTE,
)
from memagent.trajectory import Trajectory
from memagent.config import get_preset
from memagent.data import read_examples

pytestmark = pytest.mark.timeout(60)

# out of n = 8: two too hard, two too easy, 2 outside the preferred 2..6, six preferred
COUNTS = {
    'z0': 0,
    'z1': 0,
    'o1': 1,
    'o7': 7,
    'e1': 8,
    'e2': 8,
    'p2': 2,
    'p3': 3,
    'p4': 4,
    'p4b': 4,
    'p5': 5,
    'p6': 6,
}
PREFERRED = {'p2', 'p3', 'p4', 'p4b', 'p5', 'p6'}


def test_classify_hand_worked():
    cls = classify_counts(COUNTS, 8, 1, 7, (2, 6))
    tiers = {i: t for i, (t, _) in cls.items()}
    assert {i for i, t in tiers.items() if t == 'preferred'} == PREFERRED
    assert {i for i, t in tiers.items() if t == 'qualified'} == {'o1', 'o7'}
    assert {i for i, t in tiers.items() if t == 'rejected'} == {'z0', 'z1', 'e1', 'e2'}
    assert cls['z0'][1] == 'too_hard: 0 of 8 successes < min_success 1'
    assert cls['e1'][1] == 'too_easy: 8 of 8 successes > max_success 7'
    assert cls['o1'][1] == 'qualified: 1 of 8 in 1..7, outside preferred 2..6'
    # the boundaries are inclusive
    assert [classify_counts({'x': c}, 8, 1, 7, (2, 6))['x'][0] for c in range(9)] == [
        'rejected',
        'qualified',
    ] + ['preferred'] * 5 + ['qualified', 'rejected']


def test_errors_reject_whatever_the_count():
    cls = classify_counts({'a': 4, 'b': 4}, 8, 1, 7, (2, 6), errors={'a': 2})
    assert cls['a'] == (
        'rejected',
        'request_errors: 2 of 8 samples failed (count 4 is only a lower bound)',
    )
    assert cls['b'][0] == 'preferred'


@pytest.mark.parametrize('seed', range(6))
def test_preferred_first_disjoint_sizes(seed):
    sel = select_screened(COUNTS, 8, 1, 7, (2, 6), n_train=4, n_heldout=2, seed=seed)
    assert len(sel['train']) == 4 and len(sel['heldout']) == 2
    assert not set(sel['train']) & set(sel['heldout'])
    # exactly the six preferred, nothing else
    assert set(sel['train']) | set(sel['heldout']) == PREFERRED
    assert set(sel['unused']) == {'o1', 'o7'}
    sel = select_screened(COUNTS, 8, 1, 7, (2, 6), n_train=5, n_heldout=2, seed=seed)
    chosen = set(sel['train']) | set(sel['heldout'])
    assert (
        PREFERRED < chosen and len(chosen - PREFERRED) == 1 and chosen - PREFERRED <= {'o1', 'o7'}
    )


def test_seed_determinism_and_input_order():
    a = select_screened(COUNTS, n_train=3, n_heldout=2, seed=7)
    b = select_screened(dict(reversed(list(COUNTS.items()))), n_train=3, n_heldout=2, seed=7)
    assert (a['train'], a['heldout']) == (b['train'], b['heldout'])
    picks = {
        tuple(select_screened(COUNTS, n_train=3, n_heldout=2, seed=s)['train']) for s in range(10)
    }
    assert len(picks) > 1  # the seed matters


def test_too_few_refused():
    with pytest.raises(
        ScreeningError,
        match=(
            r'only 8 of 12 candidates qualify \(6 preferred, 2 outside the preferred range\) but '
            r'n_train \+ n_heldout = 8 \+ 4 = 12'
        ),
    ):
        select_screened(COUNTS, 8, 1, 7, (2, 6), n_train=8, n_heldout=4)
    sel = select_screened(COUNTS, 8, 1, 7, (2, 6), n_train=6, n_heldout=2)  # exactly enough
    assert set(sel['train']) | set(sel['heldout']) == PREFERRED | {'o1', 'o7'}


def test_no_prefer_and_bad_params():
    sel = select_screened({'a': 0, 'b': 3, 'c': 8}, 8, 0, 8, None, n_train=2, n_heldout=1)
    assert sorted(sel['train'] + sel['heldout']) == ['a', 'b', 'c']
    with pytest.raises(ValueError, match='must lie within'):
        select_screened(COUNTS, prefer=(1, 8))
    with pytest.raises(ValueError, match='min_success <= max_success <= n'):
        select_screened(COUNTS, min_success=5, max_success=3)
    with pytest.raises(ValueError, match="candidate 'x': success count"):
        select_screened({'x': -1})
    with pytest.raises(ValueError, match="candidate 'x': success count"):
        select_screened({'x': 2.0})


# screen() end to end with a rollout stand-in: example k is solved by samples 0..k-1
def cand(k):
    return {
        'id': f'q{k}',
        'question': f'What is item {k}?',
        'context': f'Item {k} is v{k}.',
        'answers': [f'v{k}'],
        'num_docs': 1,
        'source': 'synthetic',
        'meta': {'k': k},
    }


def scripted(fail=()):
    def rollout(examples, engine, tokenizer, cfg, group_size, seed, variant=None, progress=True):
        out = []
        for g, ex in enumerate(examples):
            k = int(ex['id'][1:])
            for s in range(group_size):
                t = Trajectory(
                    f"{ex['id']}#{s}",
                    ex['id'],
                    g,
                    s,
                    question=ex['question'],
                    answers=ex['answers'],
                    num_chunks=2,
                    final_text=f"so \\boxed{{{ex['answers'][0] if s < k else 'x'}}}",
                )
                if (ex['id'], s) in fail:
                    t.error = 'TransientEngineError: boom'
                out.append(t)
        return out

    return rollout


def test_screen_writes_disjoint_splits_and_manifest(tmp_path):
    cfg = get_preset('tiny')
    cands = [cand(k) for k in range(10)]
    m = screen(
        cands,
        None,
        None,
        cfg,
        n=8,
        n_train=4,
        n_heldout=2,
        seed=3,
        out_dir=tmp_path,
        batch_size=4,
        rollout_fn=scripted(fail={('q4', 0)}),
    )
    assert m['status'] == 'ok' and m['note'] == NOTE and 'NOT an unbiased metric' in NOTE
    rows = {r['id']: r for r in m['candidates']}
    assert {i: r['successes'] for i, r in rows.items()} == {
        f'q{k}': min(k, 8) for k in range(10)
    } | {'q4': 3}
    assert (
        rows['q4']['errors'] == 1
        and rows['q4']['tier'] == 'rejected'
        and rows['q4']['rewards'][0] is None
    )
    assert m['totals']['failed_requests'] == 1 and m['totals']['candidates_with_errors'] == 1
    assert m['totals']['rejected_by_reason'] == {'too_hard': 1, 'too_easy': 2, 'request_errors': 1}
    train = read_examples(tmp_path / 'train.jsonl')
    held = read_examples(tmp_path / 'heldout.jsonl')
    assert len(train) == 4 and len(held) == 2
    assert not {e['id'] for e in train} & {e['id'] for e in held}
    assert {e['id'] for e in train + held} <= {'q1', 'q2', 'q3', 'q5', 'q6', 'q7'}
    # the four preferred without errors
    assert {'q2', 'q3', 'q5', 'q6'} <= {e['id'] for e in train + held}
    assert all(
        e['meta']['screening']['successes'] == rows[e['id']]['successes']
        and e['meta']['k'] == int(e['id'][1:])
        for e in train
    )
    on_disk = json.loads((tmp_path / MANIFEST).read_text())
    assert (
        on_disk['splits']['train']['ids'] == [e['id'] for e in train]
        and len(on_disk['splits']['heldout']['sha256']) == 64
    )
    assert on_disk['parameters']['prefer'] == [2, 6] and 'git' in on_disk['provenance']
    statuses = {r['id']: r['split'] for r in on_disk['candidates']}
    assert (
        sum(v == 'train' for v in statuses.values()) == 4
        and sum(v == 'heldout' for v in statuses.values()) == 2
    )


def test_screen_insufficient_writes_manifest_only(tmp_path):
    cands = [cand(k) for k in (0, 3, 4, 9)]
    with pytest.raises(ScreeningError, match='only 2 of 4 candidates qualify'):
        screen(
            cands,
            None,
            None,
            get_preset('tiny'),
            n=8,
            n_train=2,
            n_heldout=1,
            out_dir=tmp_path,
            rollout_fn=scripted(),
        )
    m = json.loads((tmp_path / MANIFEST).read_text())
    assert m['status'] == 'insufficient' and m['splits'] is None and 'only 2 of 4' in m['failure']
    assert not (tmp_path / 'train.jsonl').exists() and not (tmp_path / 'heldout.jsonl').exists()


def test_screen_refuses_bad_candidates_and_short_groups():
    cfg = get_preset('tiny')
    with pytest.raises(ScreeningError, match="duplicate id 'q1'"):
        screen([cand(1), cand(1)], None, None, cfg, rollout_fn=scripted())
    with pytest.raises(ScreeningError, match="field 'context'"):
        screen([{**cand(1), 'context': ''}], None, None, cfg, rollout_fn=scripted())
    short = lambda ex, *a, **k: scripted()(ex, *a, **k)[:-1]
    with pytest.raises(ScreeningError, match='returned 7 trajectories, expected n=8'):
        screen([cand(2)], None, None, cfg, n_train=1, n_heldout=0, rollout_fn=short)


def test_screen_through_real_rollout(tmp_path):
    """The whole path with memagent.rollout, the real Qwen3 tokenizer and a scripted engine: failed
    requests are counted, not scored."""
    import memagent.rollout as rollout_mod
    from memagent.engines import GenerationResult, TransientEngineError
    from memagent.models import load_tokenizer

    tok = load_tokenizer('qwen3')
    stop = rollout_mod.stop_token_ids(tok)[-1]
    # samples 1 and 3 of q5 fail
    failing = {rollout_mod.request_seed(0, 'q5', s, t) for s in (1, 3) for t in range(5)}

    class Engine:
        stats = {}

        def generate(self, prompts, params, return_exceptions=False):
            out = []
            for p, sp in zip(prompts, params):
                text = tok.decode(p)
                k = next(j for j in range(10) if f'item {j}?' in text)
                if sp.seed in failing and 'Your answer:' in text:
                    out.append(TransientEngineError('timed out'))
                    continue
                ans = (
                    (f'\\boxed{{v{k}}}' if sp.seed % 8 < k else '\\boxed{no}')
                    if 'Your answer:' in text
                    else f'v{k}'
                )
                ids = tok.encode(ans, add_special_tokens=False)[: sp.max_new_tokens - 1] + [stop]
                out.append(GenerationResult(ids, [-0.5] * len(ids), 'stop', len(p), 0.0))
            return out

        def update_weights(self, state_dict=None, path=None):
            pass

        def health(self):
            return True

        def close(self):
            pass

    cands = [cand(k) for k in range(10)]
    m = screen(
        cands,
        Engine(),
        tok,
        get_preset('tiny'),
        n=8,
        min_success=0,
        max_success=8,
        prefer=None,
        n_train=2,
        n_heldout=1,
        out_dir=tmp_path,
    )
    rows = {r['id']: r for r in m['candidates']}
    assert (rows['q0']['successes'], rows['q9']['successes']) == (0, 8)
    assert m['totals']['trajectories'] == 80
    assert (
        rows['q5']['errors'] == m['totals']['failed_requests'] == 2
        and rows['q5']['tier'] == 'rejected'
    )
    assert [r is None for r in rows['q5']['rewards']] == [False, True, False, True] + [False] * 4
    assert (
        rows['q5']['reason'].startswith('request_errors: 2 of 8')
        and 'timed out' in rows['q5']['error_messages'][0]
    )
    assert not set(m['splits']['train']['ids']) & set(m['splits']['heldout']['ids'])
