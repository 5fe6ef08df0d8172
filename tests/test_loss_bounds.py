"""The loss where it can blow up: a bounded ratio, a k3 whose gradient stays finite, padding that
never matters
(NaN and infinities included), and the TIS capped fraction counted strictly above the cap."""

import math
import pytest
import torch
from memagent.config import LossCfg
from memagent.loss import policy_loss, kl_penalty


def _mini_batch(delta, credit, dtype=torch.float64):
    "Two rows of three tokens (the last of row 1 padded); one token of row 0 at log-ratio `delta`."
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=dtype)
    lp = old.clone()
    lp[0, 1] += delta
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return (
        lp.requires_grad_(),
        old,
        torch.tensor(credit, dtype=dtype),
        mask,
        torch.tensor([0.5, 0.5], dtype=dtype),
    )


def test_ratio_is_bounded_in_a_later_mini_batch():
    """Several mini-batches: the first at ratio 1, the second with one token at log-ratio 25 and a
    negative credit."""
    cfg = LossCfg(kl_type='none', dual_clip=None)  # dual clip off: the config default
    lp1, old1, c1, m1, w1 = _mini_batch(0.0, [1.0, -1.0])
    loss1, met1 = policy_loss(lp1, old1, c1, m1, w1, cfg=cfg)
    loss1.backward()
    assert torch.isfinite(lp1.grad).all() and met1['ratio_max'] == 1.0
    lp, old, c, m, w = _mini_batch(25.0, [-1.0, -1.0])
    loss, met = policy_loss(lp, old, c, m, w, cfg=cfg)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
    e20 = math.exp(20.0)  # the bounded ratio: exp(clamp(25, -20, 20))
    # credit -1: max(rho, clip(rho)) = rho per token
    want = 0.5 * (1 + e20 + 1) / 3 + 0.5 * (1 + 1) / 2
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert float(lp.grad[0, 1]) == 0.0  # past the bound the log-ratio has no gradient
    assert float(lp.grad[0, 0]) == pytest.approx(0.5 / 3, rel=1e-12)
    assert met['ratio_max'] == pytest.approx(e20, rel=1e-12)
    assert met['ratio_bound_frac'] == pytest.approx(1 / 5)
    assert met1['ratio_bound_frac'] == 0.0


def test_ratio_bound_in_fp32_past_overflow():
    "In fp32 a log-ratio above 88.7 overflows exp; the bound keeps loss and gradient finite."
    lp, old, c, m, w = _mini_batch(100.0, [-1.0, 1.0], torch.float32)
    loss, met = policy_loss(lp, old, c, m, w, cfg=LossCfg(kl_type='none'))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
    assert met['ratio_max'] == pytest.approx(math.exp(20.0), rel=1e-6)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('kind', ['low_var_kl', 'k3'])
def test_k3_gradient_finite_at_extreme_divergence(dtype, kind):
    """ref - logp = +-100: the value is the clamp (10) and the gradient is finite (0: past the
    clamp)."""
    lp = torch.tensor([-100.0, 0.0, -1.0], dtype=dtype, requires_grad=True)
    ref = torch.tensor([0.0, -100.0, -2.0], dtype=dtype)
    kl = kl_penalty(lp, ref, kind)
    kl.sum().backward()
    assert kl[:2].tolist() == [10.0, 10.0]
    assert torch.isfinite(lp.grad).all(), lp.grad
    assert lp.grad[:2].tolist() == [0.0, 0.0]
    # d/dlogp (e^d - d - 1) = 1 - e^d, d = -1
    assert float(lp.grad[2]) == pytest.approx(1 - math.exp(-1), rel=1e-2)


def _inputs(pad):
    """Four rows of five tokens with ragged padding (one row empty); every padded position of every
    tensor holds `pad`."""
    g = torch.Generator().manual_seed(5)
    shape = (4, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    t = {
        k: -torch.rand(shape, generator=g, dtype=torch.float64) * 3
        for k in ('logp', 'old_logp', 'ref_logp', 'rollout_logp')
    }
    t['entropy'] = torch.rand(shape, generator=g, dtype=torch.float64)
    t['credit'] = torch.randn(shape, generator=g, dtype=torch.float64)
    for k in t:
        t[k] = torch.where(mask.bool(), t[k], torch.full(shape, pad, dtype=torch.float64))
    return t, mask


def _run(pad, cfg):
    t, mask = _inputs(pad)
    lp = t['logp'].clone().requires_grad_()
    loss, met = policy_loss(
        lp,
        t['old_logp'],
        t['credit'],
        mask,
        torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64),
        ref_logp=t['ref_logp'],
        cfg=cfg,
        rollout_logp=t['rollout_logp'],
        entropy=t['entropy'],
    )
    loss.backward()
    return loss.detach(), lp.grad, met


@pytest.mark.parametrize('pad', [float('nan'), float('inf'), float('-inf')])
def test_non_finite_padding_never_matters(pad):
    """NaN, +inf or -inf in every padded position of every input: loss, gradient and every metric
    bit-identical to a clean run."""
    cfg = LossCfg(kl_type='low_var_kl', kl_coef=0.1, dual_clip=3.0, tis_cap=2.0, entropy_coef=0.01)
    loss0, grad0, met0 = _run(-0.25, cfg)
    loss, grad, met = _run(pad, cfg)
    assert torch.isfinite(loss0) and torch.isfinite(grad0).all()
    assert torch.equal(loss, loss0), (float(loss), float(loss0))
    assert torch.equal(grad, grad0), grad
    assert met == met0, {k: (met[k], met0[k]) for k in met if met[k] != met0.get(k)}


def test_tis_capped_fraction_counts_strictly_above_the_cap():
    """tis_cap=1 with identical log-probs: every weight is exactly 1, none was changed by the cap,
    so none counts as capped."""
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    cfg = LossCfg(kl_type='none', tis_cap=1.0)
    _, met = policy_loss(
        lp, lp, torch.ones(1), torch.ones(1, 3), torch.ones(1), cfg=cfg, rollout_logp=lp.clone()
    )
    assert met['tis_capped_frac'] == 0.0
    _, met = policy_loss(
        lp,
        lp,
        torch.ones(1),
        torch.ones(1, 3),
        torch.ones(1),
        cfg=cfg,
        rollout_logp=lp - torch.tensor([[0.0, 0.5, 0.0]]),
    )
    assert met['tis_capped_frac'] == pytest.approx(1 / 3)


def test_bound_refused_unless_positive_finite():
    "A bound that is not a positive finite number is refused by the config, naming the key."
    from memagent.config import get_preset

    for bad in (0.0, -1.0, float('inf'), float('nan')):
        with pytest.raises(ValueError, match='loss.log_ratio_bound'):
            get_preset('tiny', {'loss.log_ratio_bound': bad})
    assert get_preset('tiny', {'loss.log_ratio_bound': 5.0}).loss.log_ratio_bound == 5.0


def test_resume_reads_a_key_the_checkpoint_predates_as_its_default():
    """A checkpoint's config written before loss.log_ratio_bound existed resumes with the default;
    another value is still refused."""
    import yaml
    from memagent.config import get_preset
    from memagent.resume import ResumeError, check_resume_config

    old = get_preset('tiny').to_dict()
    del old['loss']['log_ratio_bound']
    assert check_resume_config(yaml.safe_dump(old), get_preset('tiny')) == []
    with pytest.raises(ResumeError, match='loss.log_ratio_bound: 20.0 in the checkpoint, 5.0 now'):
        check_resume_config(yaml.safe_dump(old), get_preset('tiny', {'loss.log_ratio_bound': 5.0}))
