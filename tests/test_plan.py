"""The memory plan against the real objects on CPU.

Parameters, gradient buffers and optimizer shards: the plan's counts must EQUAL megatron-core
0.16.1's `DistributedDataParallel` buffers (bucket padding included) and its distributed optimizer's
own range-map code (`DistributedOptimizer._build_gbuf_range_map`) on tiny models. The optimizer
itself needs CUDA, so the shard sizes come from megatron's range-map classmethod applied to real
`_ParamAndGradBuffer`s; DP > 1 layouts are built in this one process with a stand-in DP group that
only answers `size()` and `rank()` (the buffer and range-map code ask nothing else of it), so no
arithmetic is replaced.

Activations: the plan's local-spec and HF formulas against the bytes autograd saves for backward
during one forward (unique storages, parameters excluded), measured with
`torch.autograd.graph.saved_tensors_hooks`. Tolerance: 2% of the measured bytes (the formulas count
every saved tensor; the margin covers storages that a torch version might share or split
differently). This measures what stays alive between forward and backward, not the allocator's peak
during backward (the plan's separate 'working set' term, not measured here).
"""

import warnings

import pytest
import torch

from memagent import plan as P
from memagent.backends import megatron as mb

pytestmark = [
    pytest.mark.skipif(
        not mb.HAVE_MEGATRON,
        reason="megatron-core is not installed (pip install 'megatron-core==0.16.1')",
    ),
    pytest.mark.filterwarnings('ignore::UserWarning'),
    pytest.mark.filterwarnings('ignore::DeprecationWarning'),
]
warnings.filterwarnings('ignore', message='.*(Transformer Engine|Apex).*')

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config  # noqa: E402

TOL = 0.02


def tiny_qwen3(tied=False, **kw):
    return Qwen3Config(
        **{
            **dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=128,
                vocab_size=500,
                max_position_embeddings=256,
                tie_word_embeddings=tied,
            ),
            **kw,
        }
    )


def tiny_llama(tied=False):
    return LlamaConfig(
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=160,
        vocab_size=301,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-5,
    )


CONFIGS = {
    'qwen3': tiny_qwen3,
    'qwen3-tied': lambda: tiny_qwen3(tied=True),
    'llama-tied': lambda: tiny_llama(tied=True),
}


@pytest.fixture(scope='module', autouse=True)
def parallel():
    info = mb.init_parallel(1, 1)
    from megatron.core.tensor_parallel import random as r

    # CPU-only shim for recompute: megatron's checkpoint saves and restores the CUDA RNG state; on
    # CPU there is none (the layers have no dropout, so no random numbers are drawn); nothing that
    # is counted changes.
    saved = r._get_cuda_rng_state, r._set_cuda_rng_state
    r._get_cuda_rng_state, r._set_cuda_rng_state = (
        (lambda *a, **k: torch.get_rng_state()),
        (lambda *a, **k: None),
    )
    yield info
    r._get_cuda_rng_state, r._set_cuda_rng_state = saved
    mb.destroy_parallel()


def ddp(model, dist_opt, bucket_size=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=dist_opt,
        overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size,
    )
    with mb.cpu_shims():
        return DistributedDataParallel(config=model.config, ddp_config=cfg, module=model)


def names(model):
    return {p: n for n, p in model.named_parameters()}


@pytest.mark.parametrize('name', list(CONFIGS))
@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize(
    'dist_opt,bucket_size', [(False, None), (True, None), (True, 5000), (False, 5000)]
)
def test_param_and_grad_buffers_equal_megatron_ddp(name, dtype, dist_opt, bucket_size):
    hf = CONFIGS[name]()
    model = mb.build_gpt_model(hf, dtype=getattr(torch, dtype))
    arch = P.arch_from_hf(hf)
    specs = P.megatron_params(arch, tp=1, dtype=dtype, attention='local')
    real = [
        (n, p.numel(), str(p.dtype).removeprefix('torch.')) for n, p in model.named_parameters()
    ]
    assert [(s.name, s.numel, s.dtype) for s in specs] == real  # names, order, sizes, dtypes
    w = ddp(model, dist_opt, bucket_size)
    lay = P.ddp_layout(
        specs, dp=1, distributed_optimizer=dist_opt, grad_fp32=True, bucket_size=bucket_size
    )
    assert len(lay) == len(w.buffers)
    nm = names(model)
    for mine, buf in zip(lay, w.buffers):
        assert (mine['param_dtype'], mine['grad_dtype']) == (
            str(buf.param_dtype)[6:],
            str(buf.grad_dtype)[6:],
        )
        assert (mine['numel'], mine['numel_unpadded']) == (buf.numel, buf.numel_unpadded)
        assert mine['buckets'] == [(b.offset, b.offset + b.grad_data.numel()) for b in buf.buckets]
        assert mine['index'] == {nm[p]: v for p, v in buf.param_index_map.items()}
        # fp32 main grads
        assert buf.grad_data.numel() * buf.grad_data.element_size() == mine['numel'] * 4
        if dist_opt:
            assert (
                buf.param_data.numel() * buf.param_data.element_size()
                == mine['numel'] * P.DTYPE_BYTES[mine['param_dtype']]
            )
        else:
            assert buf.param_data is None


class StandInGroup:
    """A DP group of `size` ranks seen from `rank`: only what the buffer and range-map code ask of a
    process group."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize('name', list(CONFIGS))
@pytest.mark.parametrize('dp', [2, 4, 8])
@pytest.mark.parametrize('bucket_size', [None, 5000])
def test_optimizer_shards_equal_megatron_range_map(name, dp, bucket_size):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    hf = CONFIGS[name]()
    model = mb.build_gpt_model(hf, dtype=torch.bfloat16)
    specs = P.megatron_params(P.arch_from_hf(hf), tp=1, dtype='bfloat16', attention='local')
    lay = P.ddp_layout(specs, dp=dp, distributed_optimizer=True, bucket_size=bucket_size)
    mine = P.optimizer_shards(lay, dp)
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    groups = {}
    for n, p in model.named_parameters():
        groups.setdefault(p.dtype, []).append(p)
    nm = names(model)
    from types import SimpleNamespace
    from megatron.core import parallel_state as ps

    # the buffer's default (pg_collection=None) path calls a parallel_state function 0.16.1 lacks:
    # pass the real groups
    pgs = SimpleNamespace(
        tp=ps.get_tensor_model_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
    )
    for b, (dt, params) in enumerate(groups.items()):
        for r in range(dp):
            with mb.cpu_shims():
                buf = _ParamAndGradBuffer(
                    cfg,
                    dt,
                    torch.float32,
                    params,
                    StandInGroup(dp, r),
                    bucket_size,
                    nm,
                    1.0,
                    list(range(len(params))),
                    nccl_ub=False,
                    pg_collection=pgs,
                )
            assert (buf.numel, buf.numel_unpadded) == (lay[b]['numel'], lay[b]['numel_unpadded'])
            ranges = DistributedOptimizer._build_gbuf_range_map(buf)[(dt, torch.float32)]
            owned = sum(m['param'].size for rg in ranges for m in rg['param_map'].values())
            assert owned == mine[b][r], (dt, r)
        # padding owns nothing
        assert sum(mine[b]) == lay[b]['param_numel'] == sum(p.numel() for p in params)
    per_rank = P.optimizer_bytes(lay, dp, True)
    # one buffer: every parameter bf16, the norms too
    assert len(lay) == 1 and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert per_rank[0] == mine[0][0] * 12  # bf16: fp32 main + m + v


def test_tp2_shard_sizes_equal_the_mapping():
    """At TP 2 the plan's per-rank parameter sizes equal the shards the HF -> Megatron mapping makes
    for each rank."""
    for hf in (tiny_qwen3(), tiny_llama(tied=True), tiny_qwen3(vocab_size=511)):
        m = AutoModelForCausalLM.from_config(hf)
        specs = {
            s.name: s.numel for s in P.megatron_params(P.arch_from_hf(hf), tp=2, dtype='float32')
        }
        for rank in range(2):
            shard = mb.hf_to_megatron(m.state_dict(), hf, rank, 2)
            assert {k: v.numel() for k, v in shard.items() if k in specs} == specs
            assert set(specs) <= set(shard)


# ---- activations: formula vs the bytes autograd saves ----


def saved_bytes(model, forward):
    """Bytes of the unique storages autograd saves for backward during `forward()` (parameters
    excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    assert out.requires_grad
    return sum(seen.values())


SHAPES = [(2, 16), (1, 48)]


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('recompute', ['none', 'selective', 'full'])
@pytest.mark.parametrize(
    'attention, hf',
    [('local', tiny_qwen3), ('local', tiny_llama), ('sdpa', tiny_qwen3), ('sdpa', tiny_llama)],
)
def test_megatron_activations_match_measurement(dtype, recompute, attention, hf):
    hf = hf()
    kw = (
        {}
        if recompute == 'none'
        else dict(
            recompute_granularity=recompute,
            **(
                {'recompute_method': 'uniform', 'recompute_num_layers': 1}
                if recompute == 'full'
                else {}
            ),
        )
    )
    model = mb.build_gpt_model(hf, dtype=getattr(torch, dtype), attention=attention, **kw).train()
    arch = P.arch_from_hf(hf)
    for rows, L in SHAPES:
        ids = torch.randint(0, hf.vocab_size, (rows, L))
        pos = torch.arange(L).expand(rows, L)

        def fwd():
            with mb.cpu_shims():
                model.post_process = (
                    False  # the backend's path: decoder hidden states, the head runs in chunks
                )
                try:
                    return model(ids, pos, mb.causal_mask(L) if attention == 'local' else None)
                finally:
                    model.post_process = True

        got = saved_bytes(model, fwd)
        want = P.activation_bytes(
            arch, rows, L, tp=1, dtype=dtype, attention=attention, recompute=recompute
        )['saved_total']
        print(
            f"{attention} {hf.model_type} {dtype} {recompute} {rows}x{L}: measured {got} B, plan "
            f"{want} B ({want / got - 1:+.2%})"
        )
        assert abs(want - got) <= TOL * got


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('impl', ['sdpa', 'eager'])
def test_hf_activations_match_measurement(dtype, impl):
    hf = tiny_qwen3(tied=True)
    model = AutoModelForCausalLM.from_config(
        hf, attn_implementation=impl, dtype=getattr(torch, dtype)
    ).train()
    arch = P.arch_from_hf(hf)
    for rows, L in SHAPES:
        ids = torch.randint(0, 500, (rows, L))
        got = saved_bytes(
            model,
            lambda: (
                model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
            ),
        )
        want = P.activation_bytes(
            arch, rows, L, tp=1, dtype=dtype, attention=impl, backend='torch'
        )['saved_total']
        print(
            f"hf {impl} {dtype} {rows}x{L}: measured {got} B, plan {want} B ({want / got - 1:+.2%})"
        )
        assert abs(want - got) <= TOL * got


# ---- the run notebook ----


@pytest.mark.timeout(180)
def test_plan_notebook_renders_and_refuses(tmp_path):
    """The run notebook writes plan.json, the figure and the README for a fitting plan, and fails on
    one that does not fit."""
    import json
    from pathlib import Path

    pm = pytest.importorskip('papermill')
    root = Path(__file__).resolve().parents[1]
    run = lambda **kw: pm.execute_notebook(
        str(root / 'nbs' / 'plan.ipynb'),
        str(tmp_path / 'out.ipynb'),
        cwd=str(root),
        parameters={'out_root': str(tmp_path / 'plans'), **kw},
        progress_bar=False,
        kernel_name='python3',
    )
    run(preset='qwen3-4b-frozen', gpu_gb=80, run='fits')
    rep = tmp_path / 'plans' / 'fits'
    res = json.loads((rep / 'plan.json').read_text())
    assert (
        res['fits']
        and res['verdict'].startswith('fits')
        and 'provenance' in res
        and (rep / 'memory.png').is_file()
    )
    assert res['peak_bytes']['update'] == sum(res['update'].values()) <= res['capacity_bytes']
    readme = (rep / 'README.md').read_text()
    assert (
        '## Counterfactuals' in readme
        and 'KV cache left' in readme
        and 'the project keeps it on the GPU' in readme
    )
    eng = res['details']['engine']
    assert (
        res['settings']['offload'] is False
        and eng['kv_tokens'] >= eng['tokens_per_chunk_step']
        and eng['waves'] == 1
    )
    with pytest.raises(pm.PapermillExecutionError, match='largest term'):
        run(preset='qwen3-4b-frozen', gpu_gb=24, run='tight')
    # rendered all the same
    assert not json.loads((tmp_path / 'plans' / 'tight' / 'plan.json').read_text())['fits']


# ---- the colocated engine: what stays on the GPU during rollout, and SGLang's KV cache rule ----

FROZEN_8X80 = P.Cluster(8, 80.0, 1024.0)


def frozen(**over):
    from memagent.config import get_preset

    return get_preset('qwen3-4b-frozen', over or None)


def test_offload_is_off_by_default_and_only_a_what_if():
    """Nothing in the project offloads the trainer: the default plan keeps its state on the GPU;
    offload=True is labelled a what-if and never proposed as a fix."""
    p = P.make_plan(frozen(), FROZEN_8X80)
    assert p.settings['offload'] is False and p.host['offloaded trainer state'] == 0
    for t in ('weights', 'gradients', 'optimizer states', 'reference model'):
        assert p.rollout[f'trainer {t}'] == p.update[t] > 0  # megatron: all of it stays resident
    cf = p.counterfactuals['offload=True (what-if: not implemented)']
    assert (
        'does not implement' in cf['verdict']
        and cf['kv_tokens_per_engine'] > p.details['engine']['kv_tokens']
    )
    w = P.make_plan(frozen(), FROZEN_8X80, offload=True, search=False)
    held = sum(
        p.rollout[f'trainer {t}']
        for t in ('weights', 'gradients', 'optimizer states', 'reference model')
    )
    assert w.host['offloaded trainer state'] == 8 * held
    assert sum(v for k, v in w.rollout.items() if 'offloaded' in k) == 0
    with pytest.raises(ValueError, match='offload must be True or False'):
        P.make_plan(frozen(), FROZEN_8X80, offload=None)
    tight = P.make_plan(frozen(), P.Cluster(8, 24.0, 1024.0))
    assert not tight.fits and 'offload' not in (tight.settings['fix'] or '')


def test_kv_cache_follows_sglang_rule_on_memory_free_at_engine_start():
    """KV = f x (free when the engine starts) - engine weights: what the trainer holds then costs
    the pool f per byte, not nothing and not one."""
    p = P.make_plan(frozen(), FROZEN_8X80)
    e, ctx = p.details['engine'], int(P.CUDA_CONTEXT_GIB * P.GiB)
    free_before = 80 * P.GiB - sum(e['trainer_at_start'].values()) - 2 * ctx
    free_after = free_before - e['weights']
    assert (
        e['kv_cache'] == int(free_after - free_before * (1 - 0.7)) == p.rollout['engine KV cache']
    )
    assert e['kv_tokens'] == e['kv_cache'] // e['kv_bytes_per_token']
    # layers x (k, v) x KV heads per engine-TP rank x head_dim x bf16
    assert e['kv_bytes_per_token'] == 36 * 2 * (8 // 2) * 128 * 2
    # before the first step the optimizer holds only its fp32 main copies; Adam's m and v come with
    # the first step
    parts = max(
        P.optimizer_parts(
            P.ddp_layout(
                P.megatron_params(P.get_arch('Qwen/Qwen3-4B'), 2, 'bfloat16', 'te'), 4, True
            ),
            4,
            True,
        ),
        key=lambda x: x['main'] + x['moments'],
    )
    assert (
        e['trainer_at_start']['optimizer states'] == parts['main']
        and p.rollout['trainer optimizer states'] == parts['main'] + parts['moments']
    )
    # more trainer memory at the start: the pool shrinks by f times it
    q = P.make_plan(frozen(**{'batch.distributed_optimizer': False}), FROZEN_8X80, search=False)
    d_start = sum(q.details['engine']['trainer_at_start'].values()) - sum(
        e['trainer_at_start'].values()
    )
    assert (
        d_start > 0 and abs((e['kv_cache'] - q.details['engine']['kv_cache']) - 0.7 * d_start) <= 2
    )
    # a chunk step: 16 requests per engine of engine_context_tokens each, in one wave at 80 GB
    assert (e['requests_per_engine'], e['tokens_per_request'], e['waves']) == (
        16,
        frozen().engine_context_tokens,
        1,
    )
    assert e['kv_tokens'] >= e['tokens_per_chunk_step'] == 16 * e['tokens_per_request']


def test_torch_backend_rollout_holds_no_gradients():
    """The torch backend zeroes with set_to_none: no gradients between steps; AdamW's m and v are
    created at the first step."""
    from memagent.config import get_preset

    p = P.make_plan(get_preset('qwen3-0.6b-pilot'), P.Cluster(1, 80.0, 128.0))
    e = p.details['engine']
    assert p.rollout['trainer gradients'] == 0 < p.update['gradients']
    assert e['trainer_at_start'] == {
        'weights': p.update['weights'],
        'gradients': 0,
        'optimizer states': 0,
        'reference model': p.update['reference model'],
    }
    assert p.rollout['trainer optimizer states'] == p.update['optimizer states'] > 0
    assert p.fits and e['waves'] == 1


@pytest.mark.parametrize(
    'mem_fraction,needle',
    [(0.05, "SGLang raises 'Not enough memory'"), (0.061, 'fewer than one request')],
)
def test_engine_without_room_for_one_request_does_not_fit(mem_fraction, needle):
    p = P.make_plan(frozen(**{'rollout.mem_fraction': mem_fraction}), FROZEN_8X80)
    # the peaks alone would pass
    assert p.peak('rollout') < p.capacity and p.peak('update') < p.capacity
    assert not p.fits and 'rollout engine' in p.over()
    with pytest.raises(P.PlanDoesNotFit, match=needle):
        p.require_fit()
    assert "'gradients'" in p.verdict()  # the largest trainer term at the engine's start
    assert p.settings['fix'].startswith('rollout.mem_fraction=')
    fixed = P.make_plan(
        frozen(**{'rollout.mem_fraction': float(p.settings['fix'].split('=')[1])}),
        FROZEN_8X80,
        search=False,
    )
    assert fixed.fits


def test_chunk_step_waves():
    p = P.make_plan(frozen(**{'rollout.mem_fraction': 0.08}), FROZEN_8X80, search=False)
    e = p.details['engine']
    assert p.fits and e['concurrent_requests'] == e['kv_tokens'] // e['tokens_per_request'] == 4
    assert e['waves'] == 4 and '(4 waves)' in p.verdict()


# ---- checkpoint size on disk and the sync phase ----


@pytest.mark.parametrize(
    'backend, dtype', [('torch', 'float32'), ('megatron', 'float32'), ('megatron', 'bfloat16')]
)
def test_checkpoint_bytes_match_a_checkpoint_written_on_cpu(backend, dtype, tmp_path):
    """checkpoint_bytes against the files save_checkpoint writes for the tiny preset after one step
    (megatron: the CPU stand-in, local spec)."""
    from memagent.checkpoint import save_checkpoint
    from memagent.config import get_preset
    from memagent.policy import LocalGroup

    cfg = get_preset('tiny', {'backend': backend, 'model.dtype': dtype})
    g = LocalGroup(cfg, pad_id=0)
    b = mb.right_pad([[1, 2, 3, 4, 5], [6, 7, 8]])
    g.policy.backward(g.policy.logprobs(b).sum())
    g.policy.step()
    p = save_checkpoint(tmp_path, 1, g.hf_state_dict(), g.state_dict(), {}, '', {})
    disk = {f.relative_to(p).as_posix(): f.stat().st_size for f in p.rglob('*') if f.is_file()}
    ck = P.checkpoint_bytes(cfg, cpu_stand_in=backend == 'megatron', attention='local')
    print(backend, dtype, {k: ck[k] for k in ('model', 'optimizer')}, disk)
    # the formula counts tensor bytes; the files add headers and pickling (under 24 KiB each), the
    # small files under 32 KiB
    assert 0 <= disk['model.safetensors'] - ck['model'] < 24 * 1024
    assert 0 <= disk['optimizer/shard_0.pt'] - ck['optimizer'] < 24 * 1024
    assert 0 <= sum(disk.values()) - ck['per_checkpoint'] < 64 * 1024
    assert ck['kept'] == (cfg.schedule.keep_last + 1) * ck['per_checkpoint']


def test_sync_phase_is_the_resident_state_plus_the_gather_and_the_engine_weights():
    from memagent.config import get_preset

    p = P.make_plan(get_preset('qwen3-4b-frozen'), P.Cluster(8, 80.0, 1024.0), search=False)
    a = P.ARCHS['Qwen/Qwen3-4B']
    # the embedding, alone in its bucket
    assert p.sync['weight gather bucket (peak)'] == a.vocab * a.hidden * 2
    assert all(
        p.sync[t] == p.update[t]
        for t in ('weights', 'gradients', 'optimizer states', 'reference model')
    )
    assert (
        p.sync['engine weights'] == p.rollout['engine weights'] and 'engine KV cache' not in p.sync
    )
    assert {r['phase'] for r in p.table()} >= {
        'rollout',
        'update',
        'sync',
    } and 'sync' in p.to_dict()['peak_bytes']
    # one bucket: every split tensor
    assert (
        P.make_plan(
            get_preset('qwen3-4b-frozen'),
            P.Cluster(8, 80.0, 1024.0),
            search=False,
            sync_bucket_bytes=2**40,
        ).sync['weight gather bucket (peak)']
        > 7 * 2**30
    )
