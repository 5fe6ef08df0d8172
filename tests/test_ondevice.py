"""The virtual device (`memagent.ondevice.VirtualDevice`): the trainer's steps with both backends,
the weight check and the
evaluation run with every tensor where a GPU run needs it; a tensor left on the host stops them,
naming the operation."""

import json
import pytest, torch

from memagent.config import get_preset
from memagent.data import make_synthetic, write_examples
from memagent.ondevice import VIRTUAL, VirtualDevice, VirtualDeviceError, compute_device
from memagent.reward import REWARDS, register_reward
from memagent.trainer import Trainer

pytestmark = pytest.mark.timeout(600)

if 'test_odd_length' not in REWARDS:

    @register_reward('test_odd_length')
    def _odd(text, answers):
        """A reward with variance for a random model: 1 when the final response has an odd number of
        characters."""
        return float(len(text) % 2)


@pytest.fixture(scope='module')
def examples():
    return make_synthetic(4, num_words=40, hops=1, seed=0)


def _cfg(backend: str, **kw):
    o = {
        'grpo.reward': 'test_odd_length',
        'grpo.group_size': 4,
        'schedule.steps': 2,
        'schedule.save_every': 1,
        'optim.lr': 1e-3,
        'backend': backend,
    }
    return get_preset('tiny', {**o, **kw})


@pytest.mark.parametrize(
    'backend, attention', [('torch', None), ('megatron', 'local'), ('megatron', 'sdpa')]
)
def test_trainer_steps_and_weight_check_on_the_virtual_device(
    tmp_path, examples, backend, attention
):
    """Two GRPO steps, then the weight check after the last sync, with the policy, the reference and
    the in-process engine on the virtual device; megatron with its local spec and with
    `batch.attention='sdpa'` (rows packed)."""
    if backend == 'megatron':
        pytest.importorskip('megatron.core')
    from memagent.runcheck import WEIGHT_TOL, trainer_logprobs, weight_check, weight_prompt_ids

    with VirtualDevice() as vd:
        tr = Trainer(
            _cfg(backend, **({'batch.attention': attention} if attention else {})),
            tmp_path,
            examples,
            progress=False,
            tensorboard=False,
        )
        try:
            pol = tr.group.policy
            if attention:
                assert pol.attention == tr.group.reference.attention == attention
            assert (
                pol.device == VIRTUAL
                and tr.group.reference.device == VIRTUAL
                and tr.engine.device == VIRTUAL
            )
            assert vd.on(next(pol.model.parameters())) and vd.on(next(tr.engine.model.parameters()))
            ms = tr.train()
            if attention == 'sdpa':
                assert pol.packed_calls > 0, 'the padded micro-batches must have run packed'
            ids = weight_prompt_ids(tr.tok)
            r = weight_check(
                tr.engine, lambda i: trainer_logprobs(tr, i), ids, WEIGHT_TOL['cpu-fp32']
            )
        finally:
            tr.close()
    assert [m['step'] for m in ms] == [1, 2] and all(
        m['rows_consumed'] == m['rows_transferred'] > 0 for m in ms
    )
    assert ms[0]['grad_norm'] > 0 and ms[0]['kl'] == 0.0
    assert r['passed'] and r['max_abs_dlogp'] <= WEIGHT_TOL['cpu-fp32'], r['max_abs_dlogp']
    assert vd.checked > 1000, (
        f'only {vd.checked} operations met a device tensor: the guard saw little of the step'
    )


def test_a_micro_batch_left_on_the_host_stops_the_step(tmp_path, examples, monkeypatch):
    """The fault one H200 found (the collated rows never moved to the policy's device), put back:
    the step stops in the loss, at its first arithmetic on the rows (the padding rule's
    `torch.where`)."""
    import memagent.policy as policy

    monkeypatch.setattr(policy, 'to_device', lambda batch, device: batch)
    with VirtualDevice():
        tr = Trainer(_cfg('torch'), tmp_path, examples, progress=False, tensorboard=False)
        try:
            with pytest.raises(VirtualDeviceError, match=r'torch\.where: 1 host tensor') as e:
                tr.step()
        finally:
            tr.close()
    assert any(f.name in ('padded_to_zero', 'ppo_surrogate') for f in e.traceback)


def test_evaluation_on_the_virtual_device(tmp_path):
    """`memagent-evaluate` (its console entry) with the in-process engine on the virtual device:
    records and a summary without errors."""
    from memagent.evaluate import evaluate_cli

    data = write_examples(make_synthetic(2, num_words=60, seed=1), tmp_path / 'd.jsonl')
    with VirtualDevice() as vd:
        rc = evaluate_cli(
            [
                '--model',
                'tiny-qwen3',
                '--data',
                str(data),
                '--out',
                str(tmp_path / 'run'),
                '--samples',
                '2',
                '--no-progress',
                '--all-items',
            ]
        )
    s = json.loads((tmp_path / 'run' / 'summary.json').read_text())
    assert rc == 0 and s['errors'] == 0 and s['totals']['samples'] == 4
    assert vd.checked > 100
    assert compute_device() == torch.device('cpu')  # the guard is gone with its block
