"""Properties of credit assignment and loss aggregation that must hold for any step, not just the
worked examples."""

import math, random
import pytest
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import torch
from memagent.trajectory import Turn, Trajectory
from memagent.credit import group_advantages, expand_rows, trajectories_to_rows
from memagent.loss import policy_loss
from memagent.config import LossCfg
from memagent.transfer import balance_ranks, micro_batches, micro_batch_stats

pytestmark = pytest.mark.timeout(60)


def make_step(n_groups=3, group_size=4, seed=0, max_turns=6):
    rng = random.Random(seed)
    trajs = []
    for g in range(n_groups):
        for s in range(group_size):
            T = rng.randint(1, max_turns)
            turns = []
            for i in range(T):
                n = rng.randint(1, 7)
                turns.append(
                    Turn(
                        'memory' if i < T - 1 else 'final',
                        i,
                        [1] * rng.randint(1, 5),
                        [3] * n,
                        [-rng.random() for _ in range(n)],
                        [1] * (n - 1) + [rng.randint(0, 1)],
                    )
                )
            trajs.append(
                Trajectory(
                    f'e{g}#{s}',
                    f'e{g}',
                    g,
                    s,
                    turns=turns,
                    num_chunks=T - 1,
                    reward=float(rng.randint(0, 1)),
                )
            )
    return trajs


def test_unbiased_std_matches_torch():
    trajs = make_step(seed=1)
    adv, _ = group_advantages(trajs, 4, eps=1e-6)
    for g in range(3):
        r = torch.tensor([t.reward for t in trajs if t.group_index == g], dtype=torch.float64)
        want = (r - r.mean()) / (r.std() + 1e-6)
        got = [a for a, t in zip(adv, trajs) if t.group_index == g]
        assert torch.allclose(torch.tensor(got, dtype=torch.float64), want)


def test_every_turn_becomes_one_row():
    trajs = make_step(seed=2)
    adv, _ = group_advantages(trajs, 4)
    rows = expand_rows(trajs, adv, 'split')
    assert len(rows) == sum(t.num_turns for t in trajs)
    assert [(r.traj_id, r.turn_index) for r in rows] == [
        (t.traj_id, u.turn_index) for t in trajs for u in t.turns
    ]


def _total(rows, tid):
    return sum(r.credit * r.weight for r in rows if r.traj_id == tid)


@pytest.mark.parametrize('T', [1, 2, 5, 17])
def test_split_total_weight_independent_of_turns(T):
    # the same group, with trajectory 0 given T turns: its total gradient weight stays A_0 / N under
    # split
    trajs = make_step(n_groups=1, group_size=3, seed=3)
    t0 = trajs[0]
    t0.turns = [
        Turn('memory' if i < T - 1 else 'final', i, [1], [2, 3], [-0.1, -0.2], [1, 1])
        for i in range(T)
    ]
    t0.num_chunks = T - 1
    trajs[0].reward, trajs[1].reward, trajs[2].reward = 1.0, 0.0, 0.0
    adv, _ = group_advantages(trajs, 3)
    split = expand_rows(trajs, adv, 'split')
    share = expand_rows(trajs, adv, 'share')
    assert math.isclose(_total(split, t0.traj_id), adv[0] / 3, rel_tol=1e-12)
    assert math.isclose(_total(share, t0.traj_id), T * adv[0] / 3, rel_tol=1e-12)


def _rows_loss(rows, idx, g, cfg):
    "policy_loss on the rows `idx`, padded to the longest response among them."
    sub = [rows[i] for i in idx]
    L = max(len(r.response_ids) for r in sub)
    lp = torch.zeros(len(sub), L, dtype=torch.float64)
    old = torch.zeros_like(lp)
    mask = torch.zeros_like(lp)
    ref = torch.zeros_like(lp)
    for k, (i, r) in enumerate(zip(idx, sub)):
        n = len(r.response_ids)
        old[k, :n] = torch.tensor(r.rollout_logprobs, dtype=torch.float64)
        lp[k, :n] = old[k, :n] + torch.tensor(g[i][:n], dtype=torch.float64)
        ref[k, :n] = old[k, :n] - 0.3
        mask[k, :n] = torch.tensor(r.loss_mask, dtype=torch.float64)
    return policy_loss(
        lp,
        old,
        torch.tensor([r.credit for r in sub], dtype=torch.float64),
        mask,
        torch.tensor([r.weight for r in sub], dtype=torch.float64),
        ref_logp=ref,
        cfg=cfg,
    )[0]


@pytest.mark.parametrize('agg', ['trajectory', 'token_mean'])
@pytest.mark.parametrize('mode', ['split', 'share'])
def test_loss_invariant_to_partition(mode, agg):
    trajs = make_step(n_groups=4, group_size=4, seed=4)
    adv, _ = group_advantages(trajs, 4)
    rows = expand_rows(trajs, adv, mode, agg)
    rows = rows[: len(rows) - len(rows) % 4]
    rng = random.Random(5)
    g = [[rng.uniform(-0.5, 0.5) for _ in range(8)] for _ in rows]
    cfg = LossCfg(dual_clip=3.0)
    whole = _rows_loss(rows, list(range(len(rows))), g, cfg)
    # any partition: micro-batches of random sizes
    order = list(range(len(rows)))
    rng.shuffle(order)
    parts, s = [], 0
    while s < len(order):
        k = rng.randint(1, 5)
        parts.append(order[s : s + k])
        s += k
    assert torch.allclose(sum(_rows_loss(rows, p, g, cfg) for p in parts), whole, atol=1e-12)
    # the trainer's partition over 4 data-parallel ranks (token budget small enough to force several
    # micro-batches)
    budget = max(r.num_tokens for r in rows) * 2
    ranks = balance_ranks([r.num_tokens for r in rows], 4)
    packs = [
        [[rank[i] for i in mb] for mb in micro_batches([rows[j].num_tokens for j in rank], budget)]
        for rank in ranks
    ]
    assert sum(len(rank) for rank in packs) > 4
    per_rank = [sum(_rows_loss(rows, mb, g, cfg) for mb in rank) for rank in packs]
    assert torch.allclose(sum(per_rank), whole, atol=1e-12)


def test_token_mean_is_mean_over_all_tokens():
    trajs = make_step(n_groups=2, group_size=3, seed=6)
    adv, _ = group_advantages(trajs, 3)
    rows = expand_rows(trajs, adv, 'share', 'token_mean')
    g = [[0.0] * 8 for _ in rows]  # ratio 1: per-token pg loss is -credit
    got = _rows_loss(rows, list(range(len(rows))), g, LossCfg(kl_type='none'))
    num = sum(-r.credit * sum(r.loss_mask) for r in rows)
    den = sum(sum(r.loss_mask) for r in rows)
    assert math.isclose(float(got), num / den, rel_tol=1e-12)


def test_trajectories_to_rows_reads_recipe():
    from types import SimpleNamespace as NS

    cfg = NS(
        grpo=NS(
            group_size=4, std_normalize=True, eps=1e-6, credit='share', filter_zero_variance=False
        ),
        loss=NS(agg='trajectory'),
    )
    trajs = make_step(seed=7)
    rows, st = trajectories_to_rows(trajs, cfg)
    assert st['n_rows'] == len(rows) == sum(t.num_turns for t in trajs)
    assert all(math.isclose(r.weight, 1 / len(trajs)) for r in rows)


@pytest.mark.parametrize('dp', [1, 2, 4, 8])
def test_rank_balance_and_micro_batches_respect_the_budget_as_padded(dp):
    rng = random.Random(dp)
    lens = [rng.randint(100, 4000) for _ in range(dp * 37)]
    ranks = balance_ranks(lens, dp)
    assert (
        sorted(i for r in ranks for i in r) == list(range(len(lens)))
        and len({len(r) for r in ranks}) == 1
    )
    per_rank = []
    for r in ranks:
        L = [lens[i] for i in r]
        mbs = micro_batches(L, 9216)
        assert sorted(i for b in mbs for i in b) == list(range(len(L)))
        # padded size within the budget
        assert all(len(b) * max(L[i] for i in b) <= 9216 for b in mbs)
        per_rank.append([[L[i] for i in b] for b in mbs])
    st = micro_batch_stats(per_rank, 9216)
    assert st['max_padded'] <= 9216 and st['rows'] == len(lens) and st['real_tokens'] == sum(lens)
    assert st['micro_batches'] >= st['lower_bound_micro_batches']
    assert st['rank_imbalance'] < 0.05


def test_with_project_config():
    from memagent.config import get_preset
    from memagent.loss import loss_params

    cfg = get_preset('memagent-official')
    assert loss_params(cfg) is cfg.loss
    trajs = make_step(n_groups=2, group_size=cfg.grpo.group_size, seed=8)
    rows, st = trajectories_to_rows(trajs, cfg)
    assert (
        st['n_rows'] == len(rows) and st['credit'] == cfg.grpo.credit and st['agg'] == cfg.loss.agg
    )
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3)
    loss, met = policy_loss(
        lp, lp, torch.tensor([1.0, -1.0]), m, torch.tensor([0.5, 0.5]), ref_logp=lp, cfg=cfg
    )
    assert math.isclose(float(loss), 0.0, abs_tol=1e-7) and met['kl'] == 0.0
