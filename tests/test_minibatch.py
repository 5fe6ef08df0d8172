"""PPO mini-batches: the layout, the per-mini-batch loss normalization, the behaviour log-probs, the
clip and the step count."""

import copy, random
import pytest
import torch

from memagent.config import get_preset
from memagent.credit import expand_rows, group_advantages, mini_batch_of
from memagent.loss import policy_loss
from memagent.policy import build_policy, build_reference, update_on_rows
from memagent.trajectory import Row, Turn, Trajectory
from memagent.transfer import (
    balance_ranks,
    collate,
    layout_step,
    micro_batches,
    mini_batch_slices,
    pad_rows,
)

pytestmark = pytest.mark.timeout(300)


def make_step(n_groups, group_size=2, seed=0, vocab=60):
    rng = random.Random(seed)
    trajs = []
    for g in range(n_groups):
        for s in range(group_size):
            T = rng.randint(1, 3)
            turns = []
            for i in range(T):
                n = rng.randint(2, 6)
                turns.append(
                    Turn(
                        'memory' if i < T - 1 else 'final',
                        i,
                        [rng.randrange(1, vocab) for _ in range(rng.randint(2, 8))],
                        [rng.randrange(1, vocab) for _ in range(n)],
                        [-rng.uniform(1, 5) for _ in range(n)],
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
                    reward=float((g + s) % 2),
                )
            )
    return trajs


def step_rows(n_groups, mini_batches, agg='token_mean', mode='share', seed=0):
    trajs = make_step(n_groups, seed=seed)
    adv, _ = group_advantages(trajs, 2)
    return expand_rows(trajs, adv, mode, agg, mini_batches)


@pytest.mark.parametrize('dp,M', [(1, 2), (2, 2), (3, 4), (4, 1), (2, 8)])
def test_layout_whole_groups_padded_per_mini_batch(dp, M):
    rows = step_rows(8, M, seed=dp * 10 + M)
    laid, pad = layout_step(rows, dp, M)
    assert len(laid) == len(rows) + pad and len(laid) % dp == 0
    k = len(laid) // dp
    slices = [laid[r * k : (r + 1) * k] for r in range(dp)]
    per_rank = [mini_batch_slices(s, M) for s in slices]
    assert len({len(p) for p in per_rank}) == 1  # the same number of optimizer steps on every rank
    for j in range(len(per_rank[0])):
        parts = [[s[i] for i in p[j]] for s, p in zip(slices, per_rank)]
        assert len({len(x) for x in parts}) == 1  # each mini-batch padded to the DP size
        groups = {r.group_index for x in parts for r in x}
        assert len({mini_batch_of(g, M) for g in groups}) == 1
        real = [r for x in parts for r in x if r.weight > 0]
        want = [
            r
            for r in rows
            if mini_batch_of(r.group_index, M) == mini_batch_of(next(iter(groups)), M)
        ]
        # whole groups
        assert sorted((r.traj_id, r.turn_index) for r in real) == sorted(
            (r.traj_id, r.turn_index) for r in want
        )
        # fillers only to the next multiple of dp
        assert sum(len(x) for x in parts) - len(real) < dp
    if M == 1:  # the single-batch layout, exactly
        p, n = pad_rows(rows, dp)
        assert (laid, pad) == (
            [p[i] for rk in balance_ranks([r.num_tokens for r in p], dp) for i in rk],
            n,
        )


def _mb_loss(rows, g):
    """policy_loss of `rows` with log-prob shifts `g` (one list per row), ratio vs their rollout
    log-probs."""
    L = max(len(r.response_ids) for r in rows)
    lp = torch.zeros(len(rows), L, dtype=torch.float64)
    old = torch.zeros_like(lp)
    mask = torch.zeros_like(lp)
    for k, r in enumerate(rows):
        n = len(r.response_ids)
        old[k, :n] = torch.tensor(r.rollout_logprobs, dtype=torch.float64)
        lp[k, :n] = old[k, :n] + torch.tensor(g[k][:n], dtype=torch.float64)
        mask[k, :n] = torch.tensor(r.loss_mask, dtype=torch.float64)
    from memagent.config import LossCfg

    return policy_loss(
        lp,
        old,
        torch.tensor([r.credit for r in rows], dtype=torch.float64),
        mask,
        torch.tensor([r.weight for r in rows], dtype=torch.float64),
        cfg=LossCfg(kl_type='none'),
    )[0]


@pytest.mark.parametrize('agg', ['token_mean', 'trajectory'])
def test_each_mini_batch_loss_is_its_own_mean(agg):
    M, dp = 4, 2
    rows = step_rows(8, M, agg=agg, mode='split', seed=3)
    laid, _ = layout_step(rows, dp, M)
    k = len(laid) // dp
    slices = [laid[r * k : (r + 1) * k] for r in range(dp)]
    zero = [[0.0] * 8 for _ in range(k)]
    for j in range(M):
        # ratio 1: the per-token loss is -credit; the mini-batch's loss summed over its ranks' parts
        got = sum(_mb_loss([s[i] for i in mini_batch_slices(s, M)[j]], zero) for s in slices)
        mine = [r for r in rows if mini_batch_of(r.group_index, M) == j]
        if agg == 'token_mean':  # one mean over every response token of the mini-batch
            want = sum(-r.credit * sum(r.loss_mask) for r in mine) / sum(
                sum(r.loss_mask) for r in mine
            )
        else:  # the mean over its trajectories of each trajectory's sum of row means
            n_j = len({r.traj_id for r in mine})
            # every row here has a scored token: its row mean is -credit
            want = sum(-r.credit for r in mine) / n_j
        assert abs(float(got) - want) < 1e-12, (j, float(got), want)


def _cfg(**kw):
    o = {'optim.lr': 1e-3, 'loss.kl_coef': 0.001}
    o.update(kw)
    return get_preset('tiny', o)


def _rows_for(cfg, seed=0):
    rows = step_rows(cfg.grpo.prompts_per_step, cfg.optim.mini_batches, agg=cfg.loss.agg, seed=seed)
    return layout_step(rows, 1, cfg.optim.mini_batches)[0]


def _twin(cfg):
    "A policy and an exact copy (weights and optimizer), and the reference."
    a = build_policy(cfg, 'cpu')
    b = build_policy(cfg, 'cpu')
    b.load_state_dict(
        {k: v.clone() for k, v in a.hf_state_dict().items()}, copy.deepcopy(a.state_dict())
    )
    return a, b, build_reference(cfg, 'cpu')


def _single_step_update(policy, reference, rows, cfg, pad_id):
    "The one-optimizer-step update: behaviour log-probs = the training forward, detached; one step."
    T, parts = cfg.rollout.temperature, []
    for idx in micro_batches([r.num_tokens for r in rows], cfg.batch.max_tokens_per_micro):
        bt = collate([rows[i] for i in idx], pad_id)
        m = bt['response_mask'].clone()
        m[:, 0] = False
        with torch.no_grad():
            ref = reference.logprobs(bt, T) if reference is not None else None
        logp, ent = policy.logprobs(bt, T, with_entropy=True)
        loss, met = policy_loss(
            logp,
            logp.detach(),
            bt['credit'],
            m,
            bt['weight'],
            ref_logp=ref,
            cfg=cfg,
            rollout_logp=bt['rollout_logp'],
            entropy=ent,
        )
        policy.backward(loss)
        parts.append(met)
    return policy.step(), parts


def test_one_mini_batch_is_the_single_step_update():
    cfg = _cfg(**{'grpo.prompts_per_step': 4})
    cfg.batch.max_tokens_per_micro = (
        24  # below what the config accepts for its own rows; these rows are <= 14 tokens
    )
    rows = _rows_for(cfg, seed=5)
    a, b, ref = _twin(cfg)
    u = update_on_rows(a, ref, rows, cfg, 0)
    norm, parts = _single_step_update(b, ref, rows, cfg, 0)
    assert u['micro_batches'] == len(parts) > 1 and u['optimizer_steps'] == 1
    assert u['grad_norm'] == norm == u['grad_norm_max']
    assert u['loss'] == sum(p['loss'] for p in parts)
    assert u['ratio_min'] == u['ratio_max'] == 1.0 and u['clip_frac'] == 0.0
    wa, wb = a.hf_state_dict(), b.hf_state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_optimizer_steps_follow_the_config():
    for M in (1, 2, 4):
        cfg = _cfg(**{'optim.mini_batches': M, 'grpo.prompts_per_step': 4, 'loss.kl_coef': 0.0})
        pol = build_policy(cfg, 'cpu')
        u = update_on_rows(pol, None, _rows_for(cfg, seed=M), cfg, 0)
        steps = {int(s['step']) for s in pol.optimizer.state.values()}
        assert u['optimizer_steps'] == M and steps == {M}, (M, u['optimizer_steps'], steps)


def test_scoring_pass_is_the_training_forward():
    # lr 0: the weights never move, so the behaviour log-probs of mini-batch 2 (scored before any
    # step) equal the training forward's bit for bit: ratio exactly 1 everywhere
    cfg = _cfg(
        **{'optim.mini_batches': 2, 'optim.name': 'sgd', 'optim.lr': 0.0, 'loss.kl_coef': 0.0}
    )
    u = update_on_rows(build_policy(cfg, 'cpu'), None, _rows_for(cfg, seed=7), cfg, 0)
    assert (
        u['optimizer_steps'] == 2
        and u['ratio_min'] == u['ratio_max'] == 1.0
        and u['clip_frac'] == 0.0
    )


def test_clip_acts_once_the_ratio_leaves_one():
    o = {'optim.name': 'sgd', 'optim.lr': 1.0, 'optim.grad_clip': None, 'loss.kl_coef': 0.0}
    seen = []
    cfg2 = _cfg(**o, **{'optim.mini_batches': 2})
    rows = _rows_for(cfg2, seed=9)
    u2 = update_on_rows(build_policy(cfg2, 'cpu'), None, rows, cfg2, 0, on_progress=seen.append)
    assert [e['event'] for e in seen if e['event'] != 'micro_batch'][-4:] == [
        'optimizer_step',
        'stepped',
        'optimizer_step',
        'stepped',
    ]
    assert u2['optimizer_steps'] == 2
    lo, hi = 1 - cfg2.loss.clip_low, 1 + cfg2.loss.clip_high
    assert u2['ratio_min'] < lo or u2['ratio_max'] > hi, u2
    assert u2['clip_frac'] > 0 and u2['clip_frac_low'] + u2['clip_frac_high'] > 0, u2
    # one mini-batch on the same rows: one step, the ratio exactly 1, nothing clipped
    cfg1 = _cfg(**o)
    u1 = update_on_rows(build_policy(cfg1, 'cpu'), None, rows, cfg1, 0)
    assert (
        u1['optimizer_steps'] == 1
        and u1['ratio_min'] == u1['ratio_max'] == 1.0
        and u1['clip_frac'] == 0.0
    )


def test_slice_laid_out_for_another_count_is_refused():
    rows = step_rows(4, 1, seed=11)
    laid, _ = layout_step(rows, 1, 1)
    # groups 0, 1, 2, 3 in order
    assert [mini_batch_of(r.group_index, 2) for r in laid][:1] == [0] and len(
        {r.group_index for r in laid}
    ) == 4
    cfg = _cfg(**{'optim.mini_batches': 2, 'grpo.prompts_per_step': 4, 'loss.kl_coef': 0.0})
    with pytest.raises(
        ValueError, match='not laid out mini-batch by mini-batch for mini_batches=2'
    ):
        update_on_rows(build_policy(cfg, 'cpu'), None, laid, cfg, 0)
