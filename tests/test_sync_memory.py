"""GPU memory of the weight sync, measured on CPU: the bucketed TP gather against the plan's `sync`
term.

Two processes over gloo (TP = 2, spawned as `tests/test_megatron.py` does) run the real gather of
`MegatronBackend.hf_state_dict` on `tiny-qwen3` (and on a 512-token-vocabulary Qwen3 whose layers,
not its embedding, hold most bytes) with several bucket sizes. The exported state dict must equal
the unbucketed result (every shard gathered at once, the path this replaces) bit for bit; the most
gathered bytes a rank held at once (`peak_gather_bytes`, tracked as the gathered tensors are freed)
must stay within `memagent.plan`'s term for that model and bucket size, and with a small bucket
below the whole unsharded state dict.
"""

import functools

import pytest
import torch

from memagent.backends import megatron as mb
from memagent import plan as P

pytestmark = [
    pytest.mark.skipif(
        not mb.HAVE_MEGATRON,
        reason="megatron-core is not installed (pip install 'megatron-core==0.16.1')",
    ),
    pytest.mark.filterwarnings('ignore::UserWarning'),
    pytest.mark.filterwarnings('ignore::DeprecationWarning'),
    pytest.mark.timeout(600),
]

from test_megatron import _run_tp2, hf_model, tiny_qwen3  # noqa: E402  (the TP 2 spawn helpers and tiny models)

# the default (one bucket for these models), 1 MiB, 192 KiB, 16 KiB
BUCKETS = (
    mb.SYNC_BUCKET_BYTES,
    1 << 20,
    192 << 10,
    16 << 10,
)


def _model(name):
    if name == 'tiny-qwen3':
        from memagent.models import load_model

        return load_model('tiny-qwen3')  # seeded and cached: both ranks load the same weights
    return hf_model(tiny_qwen3())  # vocab 512, untied: the output layer is gathered too


def _unbucketed(be) -> dict:
    """The path the bucketed gather replaces: every TP shard gathered on the device at once, then
    unsharded there."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    own, group = mb.megatron_state_dict(be.model), ps.get_tensor_model_parallel_group()
    shards = [{}, {}]
    for k, t in own.items():
        if mb.tp_split_dim(k) is None:
            parts = [t, t]
        else:
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.detach().contiguous(), group=group)
        for r in range(2):
            shards[r][k] = parts[r]
    return {
        k: v.detach().clone()
        for k, v in mb.megatron_to_hf(shards, be.hf_config, include_tied=True).items()
    }


def _job_gather(name):
    import torch.distributed as dist

    hf = _model(name)
    be = mb.MegatronBackend(hf, tp=2)
    ref, out = _unbucketed(be), {}
    for b in BUCKETS:
        sd = be.hf_state_dict(bucket_bytes=b)
        same = list(sd) == list(ref) and all(
            sd[k].dtype == ref[k].dtype and torch.equal(sd[k], ref[k]) for k in ref
        )
        stats = [None, None]
        dist.all_gather_object(stats, dict(be.last_gather))
        out[b] = dict(same=same, stats=stats)
    hsd = hf.state_dict()
    out['roundtrip'] = set(sd) == set(hsd) and all(torch.equal(sd[k], hsd[k]) for k in hsd)
    return out


@pytest.fixture(scope='module', params=['tiny-qwen3', 'qwen3-vocab512'])
def gathered(request, tmp_path_factory):
    if request.param == 'tiny-qwen3':
        from memagent.models import load_model

        load_model('tiny-qwen3')  # built once here, before two processes read it
    hf = _model(request.param)
    arch = P.arch_from_hf(hf.config, name=request.param)
    return (
        request.param,
        arch,
        _run_tp2(functools.partial(_job_gather, request.param), tmp_path_factory.mktemp('tp2')),
    )


def test_bucketed_gather_is_bit_exact(gathered):
    name, _, r = gathered
    assert r['roundtrip'], f'{name}: the exported state dict is not the HF model it was loaded from'
    for b in BUCKETS:
        assert r[b]['same'], f'{name}, bucket {b}: differs from the unbucketed gather'


def test_peak_gathered_bytes_within_the_plan(gathered):
    name, arch, r = gathered
    for b in BUCKETS:
        plan = P.gather_peak_bytes(arch, tp=2, dtype='float32', attention='local', bucket_bytes=b)
        for rank, st in enumerate(r[b]['stats']):
            print(
                f"{name} bucket {b:>9} B rank {rank}: peak {st['peak_gather_bytes']:,} B (plan "
                f"{plan['peak']:,} B), "
                f"{st['buckets']} buckets, unsharded {st['unsharded_bytes']:,} B"
            )
            # every gathered tensor was freed
            assert st['tp'] == 2 and st['gathered_bytes_left'] == 0
            assert st['unsharded_bytes'] == plan['unsharded'] and st['buckets'] == plan['buckets']
            assert 0 < st['peak_gather_bytes'] <= plan['peak']
    small = r[16 << 10]['stats'][0]
    assert small['peak_gather_bytes'] < small['unsharded_bytes']
    assert (
        small['peak_gather_bytes']
        == P.gather_peak_bytes(arch, 2, 'float32', 'local', 16 << 10)['largest_tensor']
    )
    # the default bucket holds these whole models: the peak is every split tensor at once, more than
    # a small bucket's
    assert r[mb.SYNC_BUCKET_BYTES]['stats'][0]['peak_gather_bytes'] > small['peak_gather_bytes']
    # the layers hold most bytes: a small bucket keeps a small fraction of the model
    if name == 'qwen3-vocab512':
        assert small['peak_gather_bytes'] < small['unsharded_bytes'] / 4
