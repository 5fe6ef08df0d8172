"""The pilot's precision: at its learning rate one optimizer step must change the weights it trains.

At lr 1e-6 an Adam step moves a weight by about 1e-6. A bf16 weight of magnitude ~0.02 has a spacing
of 2**-13 ~ 1.2e-4, so rounding undoes that move for almost every weight: a bf16 pilot would train
next to nothing. The pilot preset therefore trains fp32 weights; these tests hold both halves of
that argument.
"""

import torch
from memagent.config import get_preset
from memagent.models import load_model
from memagent.backends.torch import TorchBackend


def _changed_fraction(dtype: str) -> tuple[float, int]:
    cfg = get_preset('qwen3-0.6b-pilot')
    torch.manual_seed(0)
    model = load_model('tiny-qwen3', dtype)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    be = TorchBackend(model, cfg.optim, cfg.optim.grad_clip)
    ids = torch.randint(5, 1000, (2, 24))
    batch = {'input_ids': ids, 'attention_mask': torch.ones_like(ids, dtype=torch.bool)}
    be.backward(-be.logprobs(batch).sum())
    be.step()
    changed = total = 0
    for k, v in model.named_parameters():
        changed += int((v.detach() != before[k]).sum())
        total += v.numel()
    return changed / total, total


def test_pilot_preset_trains_fp32_weights_at_its_learning_rate():
    cfg = get_preset('qwen3-0.6b-pilot')
    assert (cfg.model.dtype, cfg.optim.lr, cfg.backend) == ('float32', 1e-6, 'torch')
    frac, total = _changed_fraction(cfg.model.dtype)
    assert frac > 0.99, f"one step at lr 1e-6 changed only {frac:.4f} of {total} fp32 weights"


def test_bf16_weights_barely_move_at_lr_1e6():
    frac, total = _changed_fraction('bfloat16')
    assert frac < 0.05, (
        f"bf16: one step at lr 1e-6 changed {frac:.4f} of {total} weights (expected almost none)"
    )
