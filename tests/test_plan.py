"""The memory plan against the real objects on CPU.

Parameters, gradient buffers and optimizer shards: the plan's counts must EQUAL megatron-core 0.16.1's
`DistributedDataParallel` buffers (bucket padding included) and its distributed optimizer's own range-map code
(`DistributedOptimizer._build_gbuf_range_map`) on tiny models. The optimizer itself needs CUDA, so the shard
sizes come from megatron's range-map classmethod applied to real `_ParamAndGradBuffer`s; DP > 1 layouts are built
in this one process with a stand-in DP group that only answers `size()` and `rank()` (the buffer and range-map
code ask nothing else of it), so no arithmetic is replaced.

Activations: the plan's local-spec and HF formulas against the bytes autograd saves for backward during one
forward (unique storages, parameters excluded), measured with `torch.autograd.graph.saved_tensors_hooks`.
Tolerance: 2% of the measured bytes (the formulas count every saved tensor; the margin covers storages
that a torch version might share or split differently). This measures what stays alive between forward and
backward, not the allocator's peak during backward (the plan's separate 'working set' term, not measured here).
"""
import warnings

import pytest
import torch

from memagent import plan as P
from memagent.backends import megatron as mb

pytestmark = [pytest.mark.skipif(not mb.HAVE_MEGATRON, reason="megatron-core is not installed (pip install 'megatron-core==0.16.1')"),
              pytest.mark.filterwarnings('ignore::UserWarning'), pytest.mark.filterwarnings('ignore::DeprecationWarning')]
warnings.filterwarnings('ignore', message='.*(Transformer Engine|Apex).*')

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config  # noqa: E402

TOL = 0.02


def tiny_qwen3(tied=False, **kw):
    return Qwen3Config(**{**dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 intermediate_size=128, vocab_size=500, max_position_embeddings=256, tie_word_embeddings=tied), **kw})


def tiny_llama(tied=False):
    return LlamaConfig(hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, intermediate_size=160,
                       vocab_size=301, max_position_embeddings=256, tie_word_embeddings=tied, rms_norm_eps=1e-5)


CONFIGS = {'qwen3': tiny_qwen3, 'qwen3-tied': lambda: tiny_qwen3(tied=True), 'llama-tied': lambda: tiny_llama(tied=True)}


@pytest.fixture(scope='module', autouse=True)
def parallel():
    info = mb.init_parallel(1, 1)
    from megatron.core.tensor_parallel import random as r
    # CPU-only shim for recompute: megatron's checkpoint saves and restores the CUDA RNG state; on CPU there is none
    # (the layers have no dropout, so no random numbers are drawn); nothing that is counted changes.
    saved = r._get_cuda_rng_state, r._set_cuda_rng_state
    r._get_cuda_rng_state, r._set_cuda_rng_state = (lambda *a, **k: torch.get_rng_state()), (lambda *a, **k: None)
    yield info
    r._get_cuda_rng_state, r._set_cuda_rng_state = saved
    mb.destroy_parallel()


def ddp(model, dist_opt, bucket_size=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt,
                                        overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size)
    with mb.cpu_shims():
        return DistributedDataParallel(config=model.config, ddp_config=cfg, module=model)


def names(model):
    return {p: n for n, p in model.named_parameters()}


@pytest.mark.parametrize('name', list(CONFIGS))
@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('dist_opt,bucket_size', [(False, None), (True, None), (True, 5000), (False, 5000)])
def test_param_and_grad_buffers_equal_megatron_ddp(name, dtype, dist_opt, bucket_size):
    hf = CONFIGS[name]()
    model = mb.build_gpt_model(hf, dtype=getattr(torch, dtype))
    arch = P.arch_from_hf(hf)
    specs = P.megatron_params(arch, tp=1, dtype=dtype, attention='local')
    real = [(n, p.numel(), str(p.dtype).removeprefix('torch.')) for n, p in model.named_parameters()]
    assert [(s.name, s.numel, s.dtype) for s in specs] == real                      # names, order, sizes, dtypes
    w = ddp(model, dist_opt, bucket_size)
    lay = P.ddp_layout(specs, dp=1, distributed_optimizer=dist_opt, grad_fp32=True, bucket_size=bucket_size)
    assert len(lay) == len(w.buffers)
    nm = names(model)
    for mine, buf in zip(lay, w.buffers):
        assert (mine['param_dtype'], mine['grad_dtype']) == (str(buf.param_dtype)[6:], str(buf.grad_dtype)[6:])
        assert (mine['numel'], mine['numel_unpadded']) == (buf.numel, buf.numel_unpadded)
        assert mine['buckets'] == [(b.offset, b.offset + b.grad_data.numel()) for b in buf.buckets]
        assert mine['index'] == {nm[p]: v for p, v in buf.param_index_map.items()}
        assert buf.grad_data.numel() * buf.grad_data.element_size() == mine['numel'] * 4           # fp32 main grads
        if dist_opt: assert buf.param_data.numel() * buf.param_data.element_size() == mine['numel'] * P.DTYPE_BYTES[mine['param_dtype']]
        else: assert buf.param_data is None


class StandInGroup:
    "A DP group of `size` ranks seen from `rank`: only what the buffer and range-map code ask of a process group."
    def __init__(self, size, rank): self._size, self._rank = size, rank
    def size(self): return self._size
    def rank(self): return self._rank


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
    for n, p in model.named_parameters(): groups.setdefault(p.dtype, []).append(p)
    nm = names(model)
    from types import SimpleNamespace
    from megatron.core import parallel_state as ps
    # the buffer's default (pg_collection=None) path calls a parallel_state function 0.16.1 lacks: pass the real groups
    pgs = SimpleNamespace(tp=ps.get_tensor_model_parallel_group(), dp_cp=ps.get_data_parallel_group(with_context_parallel=True))
    for b, (dt, params) in enumerate(groups.items()):
        for r in range(dp):
            with mb.cpu_shims():
                buf = _ParamAndGradBuffer(cfg, dt, torch.float32, params, StandInGroup(dp, r), bucket_size, nm, 1.0,
                                          list(range(len(params))), nccl_ub=False, pg_collection=pgs)
            assert (buf.numel, buf.numel_unpadded) == (lay[b]['numel'], lay[b]['numel_unpadded'])
            ranges = DistributedOptimizer._build_gbuf_range_map(buf)[(dt, torch.float32)]
            owned = sum(m['param'].size for rg in ranges for m in rg['param_map'].values())
            assert owned == mine[b][r], (dt, r)
        assert sum(mine[b]) == lay[b]['param_numel'] == sum(p.numel() for p in params)   # padding owns nothing
    per_rank = P.optimizer_bytes(lay, dp, True)
    assert per_rank[0] == mine[0][0] * 12 + mine[1][0] * 8          # bf16: fp32 main + m + v; fp32 norms: m + v


def test_tp2_shard_sizes_equal_the_mapping():
    "At TP 2 the plan's per-rank parameter sizes equal the shards the HF -> Megatron mapping makes for each rank."
    for hf in (tiny_qwen3(), tiny_llama(tied=True), tiny_qwen3(vocab_size=511)):
        m = AutoModelForCausalLM.from_config(hf)
        specs = {s.name: s.numel for s in P.megatron_params(P.arch_from_hf(hf), tp=2, dtype='float32')}
        for rank in range(2):
            shard = mb.hf_to_megatron(m.state_dict(), hf, rank, 2)
            assert {k: v.numel() for k, v in shard.items() if k in specs} == specs
            assert set(specs) <= set(shard)


# ---- activations: formula vs the bytes autograd saves ----

def saved_bytes(model, forward):
    "Bytes of the unique storages autograd saves for backward during `forward()` (parameters excluded)."
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}
    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params: seen.setdefault(s.data_ptr(), s.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    assert out.requires_grad
    return sum(seen.values())


SHAPES = [(2, 16), (1, 48)]


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('recompute', ['none', 'selective', 'full'])
def test_local_spec_activations_match_measurement(dtype, recompute):
    hf = tiny_qwen3()
    kw = {} if recompute == 'none' else dict(recompute_granularity=recompute,
                                             **({'recompute_method': 'uniform', 'recompute_num_layers': 1} if recompute == 'full' else {}))
    model = mb.build_gpt_model(hf, dtype=getattr(torch, dtype), **kw).train()
    arch = P.arch_from_hf(hf)
    for rows, L in SHAPES:
        ids = torch.randint(0, 500, (rows, L))
        pos = torch.arange(L).expand(rows, L)
        def fwd():
            with mb.cpu_shims():
                model.post_process = False       # the backend's path: decoder hidden states, the head runs in chunks
                try: return model(ids, pos, mb.causal_mask(L))
                finally: model.post_process = True
        got = saved_bytes(model, fwd)
        want = P.activation_bytes(arch, rows, L, tp=1, dtype=dtype, attention='local', recompute=recompute)['saved_total']
        print(f"local {dtype} {recompute} {rows}x{L}: measured {got} B, plan {want} B ({want / got - 1:+.2%})")
        assert abs(want - got) <= TOL * got


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('impl', ['sdpa', 'eager'])
def test_hf_activations_match_measurement(dtype, impl):
    hf = tiny_qwen3(tied=True)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation=impl, dtype=getattr(torch, dtype)).train()
    arch = P.arch_from_hf(hf)
    for rows, L in SHAPES:
        ids = torch.randint(0, 500, (rows, L))
        got = saved_bytes(model, lambda: model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state)
        want = P.activation_bytes(arch, rows, L, tp=1, dtype=dtype, attention=impl)['saved_total']
        print(f"hf {impl} {dtype} {rows}x{L}: measured {got} B, plan {want} B ({want / got - 1:+.2%})")
        assert abs(want - got) <= TOL * got


# ---- the run notebook ----

@pytest.mark.timeout(180)
def test_plan_notebook_renders_and_refuses(tmp_path):
    "The run notebook writes plan.json, the figure and the README for a fitting plan, and fails on one that does not fit."
    import json
    from pathlib import Path
    pm = pytest.importorskip('papermill')
    root = Path(__file__).resolve().parents[1]
    run = lambda **kw: pm.execute_notebook(str(root / 'nbs' / 'plan.ipynb'), str(tmp_path / 'out.ipynb'), cwd=str(root),
                                           parameters={'out_root': str(tmp_path / 'plans'), **kw}, progress_bar=False, kernel_name='python3')
    run(preset='qwen3-4b-frozen', gpu_gb=80, run='fits')
    rep = tmp_path / 'plans' / 'fits'
    res = json.loads((rep / 'plan.json').read_text())
    assert res['fits'] and res['verdict'].startswith('fits') and 'provenance' in res and (rep / 'memory.png').is_file()
    assert res['peak_bytes']['update'] == sum(res['update'].values()) <= res['capacity_bytes']
    assert '## Counterfactuals' in (rep / 'README.md').read_text()
    with pytest.raises(pm.PapermillExecutionError, match='largest term'):
        run(preset='qwen3-4b-frozen', gpu_gb=24, run='tight')
    assert not json.loads((tmp_path / 'plans' / 'tight' / 'plan.json').read_text())['fits']    # rendered all the same
