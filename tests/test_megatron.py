"""Megatron-core backend on CPU: HF <-> Megatron mapping, logits equivalence, optimizer step,
export/reload.

One process, world size 1 (gloo), except the tensor-parallel tests at the end, which run on two
spawned ranks (TP = 2, gloo; started once and reused, each job in a fresh process group) and compare
with the HF model and with TP = 1 run here. Tiny random Qwen3 and Llama models only. Skipped, with
the reason, when megatron-core is not installed.
"""

import json, subprocess, sys, warnings

import pytest
import torch

from memagent.backends import megatron as mb
from memagent.net import free_port

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


@pytest.fixture(scope='module', autouse=True)
def parallel():
    info = mb.init_parallel(1, 1)
    yield info
    mb.destroy_parallel()


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
                vocab_size=512,
                max_position_embeddings=256,
                tie_word_embeddings=tied,
            ),
            **kw,
        }
    )


def tiny_llama(tied=False, **kw):
    return LlamaConfig(
        **{
            **dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=128,
                vocab_size=512,
                max_position_embeddings=256,
                tie_word_embeddings=tied,
                rms_norm_eps=1e-5,
            ),
            **kw,
        }
    )


CONFIGS = {
    'qwen3': lambda: tiny_qwen3(),
    'qwen3-tied': lambda: tiny_qwen3(tied=True),
    'llama': lambda: tiny_llama(),
    'llama-tied': lambda: tiny_llama(tied=True),
}


def cpu(sd):
    "Tensors on the CPU (the backend's live on its device)."
    return {k: v.cpu() for k, v in sd.items()}


def hf_model(cfg, seed=0):
    "A seeded random HF model; norm weights drawn around 1 so a swapped norm cannot hide."
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation='eager').float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(
                (1 + 0.2 * torch.randn(p.shape, generator=g))
                if 'norm' in n
                else 0.05 * torch.randn(p.shape, generator=g)
            )
    return m


def hf_logprobs(model, batch):
    logits = model(
        input_ids=batch['input_ids'], attention_mask=batch['attention_mask']
    ).logits.float()
    out = torch.zeros(batch['input_ids'].shape)
    out[:, 1:] = (
        logits[:, :-1].log_softmax(-1).gather(-1, batch['input_ids'][:, 1:, None]).squeeze(-1)
    )
    want = batch['attention_mask'].bool() & batch['response_mask'].bool()
    want[:, 0] = False
    return out * want


@pytest.fixture(scope='module')
def batch():
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (12, 7, 10)]
    return mb.right_pad(seqs, masks=[[0] * 4 + [1] * (len(s) - 4) for s in seqs])


def test_import_without_megatron():
    code = (
        "import sys; sys.modules['megatron'] = None\nimport memagent.backends.megatron as "
        "m\nassert not m.HAVE_MEGATRON\nassert m.right_pad([[1, 2]])['input_ids'].tolist() == "
        "[[1, 2]]\ntry: m.init_parallel()\nexcept ImportError as e: print('ImportError:', e)\n"
    )
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert 'megatron-core' in r.stdout


def test_parallel_state_idempotent(parallel):
    assert (parallel.world_size, parallel.tp, parallel.pp, parallel.dp) == (1, 1, 1, 1)
    assert mb.init_parallel(1, 1) == parallel
    with pytest.raises(ValueError, match='not divisible'):
        mb.init_parallel(2, 1)


def test_cpu_shims_restore():
    if torch.cuda.is_available():
        pytest.skip('shims are inactive with CUDA')
    orig = torch.cuda.current_device
    with mb.cpu_shims() as active:
        assert active and torch.cuda.current_device() == 'cpu'
    assert torch.cuda.current_device is orig


def test_config_mapping():
    tc, gk = mb.megatron_config_from_hf(tiny_qwen3(num_attention_heads=8, head_dim=32))
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels, tc.qk_layernorm) == (
        8,
        2,
        32,
        True,
    )
    assert (tc.normalization, tc.layernorm_epsilon, tc.gated_linear_unit, tc.add_bias_linear) == (
        'RMSNorm',
        1e-6,
        True,
        False,
    )
    assert tc.params_dtype == torch.float32 and tc.hidden_dropout == 0 and tc.attention_dropout == 0
    assert (gk['rotary_base'], gk['share_embeddings_and_output_weights']) == (10000.0, False)
    tc, gk = mb.megatron_config_from_hf(tiny_llama(tied=True, rope_theta=500000.0))
    assert (tc.qk_layernorm, tc.layernorm_epsilon, tc.kv_channels) == (False, 1e-5, 16)
    assert (gk['rotary_base'], gk['share_embeddings_and_output_weights']) == (500000.0, True)


@pytest.mark.parametrize(
    'cfg, field',
    [
        (lambda: tiny_llama(attention_bias=True), 'attention_bias'),
        (lambda: tiny_llama(mlp_bias=True), 'mlp_bias'),
        (lambda: tiny_llama(hidden_act='gelu'), 'hidden_act'),
        (lambda: tiny_qwen3(use_sliding_window=True, sliding_window=8), 'use_sliding_window'),
        (lambda: tiny_llama(rope_scaling={'rope_type': 'linear', 'factor': 2.0}), 'rope_type'),
    ],
)
def test_unsupported_configs_are_refused(cfg, field):
    with pytest.raises(ValueError, match=field):
        mb.megatron_config_from_hf(cfg())


def test_qkv_grouped_query_order():
    a = dict(heads=4, groups=2, head_dim=1)
    q, k, v = (
        torch.tensor([[0.0], [1.0], [2.0], [3.0]]),
        torch.tensor([[10.0], [11.0]]),
        torch.tensor([[20.0], [21.0]]),
    )
    w = mb._fuse_qkv(q, k, v, a)
    assert w.flatten().tolist() == [0.0, 1.0, 10.0, 20.0, 2.0, 3.0, 11.0, 21.0]
    assert [t.flatten().tolist() for t in mb._split_qkv(w, a)] == [
        [0.0, 1.0, 2.0, 3.0],
        [10.0, 11.0],
        [20.0, 21.0],
    ]


def test_mapping_names_match_built_model():
    for cfg in (tiny_qwen3(), tiny_llama(tied=True)):
        model = mb.build_gpt_model(cfg)
        msd = mb.hf_to_megatron(hf_model(cfg).state_dict(), cfg)
        own = mb.megatron_state_dict(model)
        assert set(msd) == set(own)
        assert all(msd[k].shape == own[k].shape for k in own)


@pytest.mark.parametrize('name', list(CONFIGS))
def test_logits_and_roundtrip(name, batch):
    cfg = CONFIGS[name]()
    hf = hf_model(cfg)
    be = mb.MegatronBackend(hf, head_chunk=5)
    real = batch['attention_mask'].bool()
    with torch.no_grad():
        ref = hf(input_ids=batch['input_ids'], attention_mask=batch['attention_mask']).logits
        d_logits = (be.logits(batch['input_ids']).cpu() - ref)[real].abs().max().item()
        d_logp = (be.logprobs(batch).cpu() - hf_logprobs(hf, batch)).abs().max().item()
    print(f'{name}: max|logits diff| {d_logits:.2e}, max|logp diff| {d_logp:.2e}')
    assert d_logits < 1e-4 and d_logp < 1e-4
    sd, rt = hf.state_dict(), cpu(be.hf_state_dict())
    assert set(rt) == set(sd)
    for k in sd:
        assert torch.equal(rt[k], sd[k]), k
    # and the pure functions on their own
    msd = mb.hf_to_megatron(sd, cfg)
    back = mb.megatron_to_hf(msd, cfg, include_tied=True)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert ('lm_head.weight' in mb.megatron_to_hf(msd, cfg, include_tied=False)) == (
        not cfg.tie_word_embeddings
    )


def test_head_dim_differs_from_hidden_over_heads(batch):
    hf = hf_model(tiny_qwen3(num_attention_heads=8, num_key_value_heads=4, head_dim=32))
    be = mb.MegatronBackend(hf)
    with torch.no_grad():
        ref = hf(input_ids=batch['input_ids'], attention_mask=batch['attention_mask']).logits
        d = (
            (be.logits(batch['input_ids']).cpu() - ref)[batch['attention_mask'].bool()]
            .abs()
            .max()
            .item()
        )
    assert d < 1e-4


def test_naive_qkv_concatenation_is_detected(batch):
    """The equivalence check has teeth: stacking [q; k; v] without grouping gives visibly different
    logits."""
    cfg = tiny_qwen3()
    hf = hf_model(cfg)
    be = mb.MegatronBackend(hf)
    sd = hf.state_dict()
    with torch.no_grad():
        for i in range(cfg.num_hidden_layers):
            w = torch.cat([sd[f'model.layers.{i}.self_attn.{x}_proj.weight'] for x in 'qkv'])
            be.model.decoder.layers[i].self_attention.linear_qkv.weight.copy_(w)
        ref = hf(input_ids=batch['input_ids'], attention_mask=batch['attention_mask']).logits
        d = (
            (be.logits(batch['input_ids']).cpu() - ref)[batch['attention_mask'].bool()]
            .abs()
            .max()
            .item()
        )
    assert d > 1e-3


def test_chunk_size_does_not_change_logprobs(batch):
    hf = hf_model(tiny_llama())
    be = mb.MegatronBackend(hf)
    with torch.no_grad():
        outs = []
        for c in (1, 7, 4096):
            be.head_chunk = c
            outs.append(be.logprobs(batch).cpu())
    assert all(torch.allclose(o, outs[0], atol=1e-6) for o in outs)
    # zero outside the response and at padding
    want = batch['response_mask'].bool() & batch['attention_mask'].bool()
    assert (outs[0][~want] == 0).all() and (outs[0][want] < 0).all()


def test_temperature(batch):
    hf = hf_model(tiny_qwen3())
    be = mb.MegatronBackend(hf)
    with torch.no_grad():
        ref = (hf(input_ids=batch['input_ids']).logits[:, :-1] / 0.7).log_softmax(-1)
        ref = ref.gather(-1, batch['input_ids'][:, 1:, None]).squeeze(-1)
        lp = be.logprobs(batch, temperature=0.7)[:, 1:].cpu()
    want = (batch['response_mask'].bool() & batch['attention_mask'].bool())[:, 1:]
    assert (lp - ref)[want].abs().max() < 1e-5


def test_bad_batches_are_refused(batch):
    be = mb.MegatronBackend(hf_model(tiny_qwen3()))
    left = dict(batch, attention_mask=batch['attention_mask'].flip(1))
    with pytest.raises(ValueError, match='right-padded'):
        be.logprobs(left)
    with pytest.raises(ValueError, match='position_ids'):
        be.logprobs(dict(batch, position_ids=batch['position_ids'] + 1))
    with pytest.raises(NotImplementedError, match='pipeline parallelism'):
        mb.MegatronBackend(hf_model(tiny_qwen3()), pp=2)
    with pytest.raises(ValueError, match='num_key_value_heads=2 is not divisible'):
        mb.MegatronBackend(hf_model(tiny_qwen3()), tp=4)
    with pytest.raises(ValueError, match='not divisible by tp'):  # world size 1 cannot hold tp=2
        mb.MegatronBackend(hf_model(tiny_qwen3()), tp=2)


def pg_loss(logp, batch, adv):
    m = (batch['response_mask'] * batch['attention_mask']).float().to(logp.device)
    m[:, 0] = 0
    return -((adv.to(logp.device)[:, None] * logp) * m).sum() / m.sum()


@pytest.mark.parametrize('opt, lr', [('sgd', 0.5), ('adam', 1e-3)])
def test_one_step_matches_hf(opt, lr, batch):
    adv = torch.tensor([1.0, -0.5, 0.25])
    hf = hf_model(tiny_qwen3())
    be = mb.MegatronBackend(hf, optimizer=opt, lr=lr, grad_clip=None, head_chunk=4)
    hopt = (
        torch.optim.SGD(hf.parameters(), lr=lr)
        if opt == 'sgd'
        else torch.optim.Adam(hf.parameters(), lr=lr)
    )
    l0_hf = pg_loss(hf_logprobs(hf, batch), batch, adv)
    l0_hf.backward()
    hf_norm = torch.nn.utils.clip_grad_norm_(list(hf.parameters()), float('inf')).item()
    hopt.step()
    hopt.zero_grad()
    l0_mg, norm = be.train_step(lambda b: pg_loss(b.logprobs(batch), batch, adv))
    assert abs(l0_mg - l0_hf.item()) < 1e-5 and abs(norm - hf_norm) < 1e-4
    with torch.no_grad():
        l1_hf = pg_loss(hf_logprobs(hf, batch), batch, adv).item()
        l1_mg = pg_loss(be.logprobs(batch), batch, adv).item()
    print(f'{opt}: {l0_mg:.6f} -> HF {l1_hf:.6f}, Megatron {l1_mg:.6f}')
    assert abs(l1_mg - l0_mg) > 1e-3 and abs(l1_hf - l1_mg) < 1e-4
    if opt == 'sgd':
        new = cpu(be.hf_state_dict())
        assert max((new[k] - v).abs().max().item() for k, v in hf.state_dict().items()) < 1e-6


def test_microbatch_accumulation_equals_one_batch(batch):
    """backward on two row subsets (weighted by their token share) then one step == one step on all
    rows."""
    adv = torch.tensor([1.0, -0.5, 0.25])
    m = (batch['response_mask'] * batch['attention_mask']).float()
    m[:, 0] = 0
    n = m.sum()

    def part(be, rows):
        sub = {k: v[rows] for k, v in batch.items()}
        return -((adv[rows][:, None] * be.logprobs(sub).cpu()) * m[rows]).sum() / n

    a = mb.MegatronBackend(hf_model(tiny_llama()), optimizer='sgd', lr=0.5, grad_clip=None)
    b = mb.MegatronBackend(hf_model(tiny_llama()), optimizer='sgd', lr=0.5, grad_clip=None)
    na = a.step(part(a, [0, 1, 2]))
    b.backward(part(b, [0]))
    nb = b.step(part(b, [1, 2]))
    assert abs(na - nb) < 1e-5
    sa, sb = cpu(a.hf_state_dict()), cpu(b.hf_state_dict())
    assert max((sa[k] - sb[k]).abs().max().item() for k in sa) < 1e-6


def test_grad_clip_reports_preclip_norm(batch):
    adv = torch.tensor([1.0, -0.5, 0.25])
    be = mb.MegatronBackend(hf_model(tiny_qwen3()), optimizer='sgd', lr=0.0, grad_clip=1e-3)
    norm = be.step(pg_loss(be.logprobs(batch), batch, adv))
    assert norm > 1e-3
    assert all(p.grad is None for p in be.model.parameters())


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {'<unk>': 0, '<eos>': 1, **{f'w{i}': i + 2 for i in range(50)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='<unk>', eos_token='<eos>')


@pytest.mark.parametrize('name', ['qwen3', 'llama-tied'])
def test_export_reloads_with_transformers(name, batch, tmp_path):
    cfg = CONFIGS[name]()
    be = mb.MegatronBackend(hf_model(cfg), optimizer='sgd', lr=0.5)
    adv = torch.tensor([1.0, -0.5, 0.25])
    # export trained weights, not the HF ones we loaded
    be.step(pg_loss(be.logprobs(batch), batch, adv))
    out = be.save_hf(tmp_path / 'hf', tokenizer=_tiny_tokenizer())
    names = {p.name for p in out.iterdir()}
    assert {'config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json'} <= names
    re = AutoModelForCausalLM.from_pretrained(out, attn_implementation='eager').float().eval()
    assert re.config.tie_word_embeddings == cfg.tie_word_embeddings
    with torch.no_grad():
        d = (
            (re(input_ids=batch['input_ids']).logits - be.logits(batch['input_ids']).cpu())
            .abs()
            .max()
            .item()
        )
    assert d < 1e-4
    sd = cpu(be.hf_state_dict())
    assert all(torch.equal(v, sd[k]) for k, v in re.state_dict().items())
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).encode('w3 w4') == [5, 6]


def test_from_config():
    from memagent.config import get_preset

    cfg = get_preset('tiny', {'optim.warmup_steps': 2})
    be = mb.MegatronBackend.from_config(cfg, hf_model(tiny_qwen3()))
    assert be.optimizer.param_groups[0]['lr'] == cfg.optim.lr / 2, (
        'the same linear warm-up as the torch backend'
    )
    assert be.grad_clip == cfg.optim.grad_clip


# ---- building from the checkpoint's files (what build_policy hands a megatron backend) ----


def _step_need(sd, cfg, dt):
    """The most bytes one step of the streaming load holds: one Megatron weight's HF tensors in
    `dt`, and their fusion where there is one."""
    from memagent.backends.megatron.mapping import _megatron_sources

    return max(
        sum(sd[k].numel() for k in hks) * dt.itemsize * (1 if len(hks) == 1 else 2)
        for _, hks in _megatron_sources(mb.hf_arch(cfg))
    )


@pytest.mark.parametrize('name', ['qwen3', 'llama-tied'])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_backend_from_checkpoint_files_equals_backend_from_hf_model(name, dtype, tmp_path):
    """The weights read tensor by tensor from safetensors (sharded files, through the index) are
    those of the HF model from_pretrained builds, bit for bit, in the model dtype."""
    from memagent.models import load_checkpoint, load_model

    hf, d, dt = hf_model(CONFIGS[name]()), tmp_path / 'm', getattr(torch, dtype)
    hf.save_pretrained(d, max_shard_size='100KB')
    assert len(list(d.glob('*.safetensors'))) > 1
    a = mb.MegatronBackend(load_checkpoint(d, dtype), dtype=dt)
    b = mb.MegatronBackend(load_model(d, dtype), dtype=dt)
    sa, sb = mb.megatron_state_dict(a.model), mb.megatron_state_dict(b.model)
    assert list(sa) == list(sb) and all(
        torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sb
    )
    assert a.hf_config.to_dict() == b.hf_config.to_dict()
    st = a.load_stats
    assert (
        st['peak_read_bytes'] == _step_need(hf.state_dict(), CONFIGS[name](), dt)
        and st['read_bytes_left'] == 0
    )
    assert (
        st['peak_read_bytes'] < sum(t.numel() * dt.itemsize for t in hf.state_dict().values()) / 3
    )
    assert 'peak_read_bytes' not in b.load_stats and b.load_stats['tensors'] == len(sa)


def test_checkpoint_missing_a_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    from memagent.models import load_checkpoint

    d = tmp_path / 'm'
    hf_model(tiny_qwen3()).save_pretrained(d)
    f = d / 'model.safetensors'
    sd = load_file(f)
    del sd['lm_head.weight']
    save_file(sd, f, metadata={'format': 'pt'})
    with pytest.raises(
        KeyError, match=rf"checkpoint {d} lacks 1 tensors, e.g. \['lm_head.weight'\]"
    ):
        mb.MegatronBackend(load_checkpoint(d))


_HUB_POLICY = r"""
import sys, warnings, torch
warnings.filterwarnings('ignore')
from memagent.config import get_preset
from memagent.policy import build_policy, build_reference
from memagent.backends import megatron as mb
cfg = get_preset('tiny', {'backend': 'megatron', 'model.name': 'Org/Tiny', 'loss.kl_type': 'low_var_kl', 'loss.kl_coef': 0.01})
pol, ref = build_policy(cfg, 'cpu'), build_reference(cfg, 'cpu')
built = sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m and '.auto.' not in m)
assert not built, f'the module of an HF model class was imported: {built}'   # auto's name tables may be, by megatron or transformers
from memagent.models import load_model
hf = load_model('Org/Tiny').state_dict()
for be in (pol, ref):
    got = be.hf_state_dict()
    assert set(got) == set(hf) and all(torch.equal(got[k], hf[k]) for k in hf)
    assert be.load_stats['peak_read_bytes'] < sum(t.nbytes for t in hf.values()) / 2, be.load_stats
print('ok', pol.load_stats)
"""  # noqa: E501


def test_build_policy_reads_a_hub_checkpoint_and_builds_no_hf_model(tmp_path):
    """build_policy/build_reference on the megatron backend, for a hub id served from an offline hub
    cache: the weights come from the snapshot's files, and no HF model class is even imported."""
    import shutil
    from memagent.models import model_dir

    snap = tmp_path / 'hub' / 'models--Org--Tiny' / 'snapshots' / ('a' * 40)
    shutil.copytree(model_dir('tiny-qwen3'), snap)
    (tmp_path / 'hub' / 'models--Org--Tiny' / 'refs').mkdir()
    (tmp_path / 'hub' / 'models--Org--Tiny' / 'refs' / 'main').write_text('a' * 40)
    env = {
        k: v
        for k, v in __import__('os').environ.items()
        if k not in ('RANK', 'WORLD_SIZE', 'MASTER_PORT', 'LOCAL_RANK')
    }
    env.update(HF_HUB_CACHE=str(tmp_path / 'hub'), HF_HUB_OFFLINE='1', OMP_NUM_THREADS='1')
    r = subprocess.run(
        [sys.executable, '-c', _HUB_POLICY], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and 'ok' in r.stdout, r.stderr[-3000:]


# ---- tensor parallelism (TP = 2): pure sharding in this process, the model in two spawned
# processes ----


def test_shard_unshard_is_exact_and_shapes_match_built_model():
    for cfg in (tiny_qwen3(), tiny_llama(tied=True), tiny_qwen3(vocab_size=511)):
        hf = hf_model(cfg)
        full = mb.hf_to_megatron(hf.state_dict(), cfg)
        shards = [mb.hf_to_megatron(hf.state_dict(), cfg, r, 2) for r in range(2)]
        back = mb.unshard_megatron(shards, vocab=cfg.vocab_size)
        assert set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)
        rt = mb.megatron_to_hf(shards, cfg)
        assert all(torch.equal(rt[k], v) for k, v in hf.state_dict().items())
        qkv = 'decoder.layers.0.self_attention.linear_qkv.weight'
        # whole groups, in order
        assert torch.equal(shards[1][qkv], full[qkv][full[qkv].shape[0] // 2 :])
        fc1 = 'decoder.layers.0.mlp.linear_fc1.weight'
        gate, up = full[fc1].chunk(2)
        # gate and up each split
        assert torch.equal(shards[0][fc1], torch.cat([gate[:64], up[:64]]))
        assert (
            shards[0]['embedding.word_embeddings.weight'].shape[0]
            == mb.padded_vocab(cfg.vocab_size, 2) // 2
        )
    with pytest.raises(ValueError, match='num_key_value_heads'):
        mb.hf_to_megatron(hf.state_dict(), cfg, 0, 4)


def _tp_server(rank, world, jobs, results):
    """One TP rank, kept for the test process: for each `(job, port, out_path)` it is sent, joins a
    fresh process group on
        `port`, runs `job` (rank 0 saves its result dict to `out_path`), tears the parallel state
        down
        and reports
        `(rank, traceback or None)`. The spawn and the imports are paid once, not once per test."""
    import os, traceback

    warnings.filterwarnings('ignore')
    while (item := jobs.get()) is not None:
        job, port, out_path = item
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port)
        )
        err = None
        try:
            res = job()
            if rank == 0:
                torch.save(res, out_path)
        except BaseException:
            err = traceback.format_exc()
        finally:
            try:
                mb.destroy_parallel()
            except BaseException:
                err = (err or '') + traceback.format_exc()
        results.put((rank, err))


class _TP2Ranks:
    """Two spawned TP ranks that run one job at a time; any error, death or timeout ends both, and
    the next job starts new ones."""

    def __init__(self, world=2):
        import torch.multiprocessing as mp

        ctx = mp.get_context('spawn')
        self.jobs, self.results = [ctx.Queue() for _ in range(world)], ctx.Queue()
        self.procs = [
            ctx.Process(target=_tp_server, args=(r, world, self.jobs[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def alive(self):
        return all(p.is_alive() for p in self.procs)

    def run(self, job, out, timeout_s=600):
        import queue, time

        port = free_port()
        for q in self.jobs:
            q.put((job, port, str(out)))
        done, end = 0, time.monotonic() + timeout_s
        while done < len(self.procs):
            try:
                rank, err = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > end:
                    self.close()
                    raise RuntimeError(
                        f"TP 2 job {job!r}: "
                        + (f"ranks exited {dead}" if dead else f"no answer within {timeout_s} s")
                    )
                continue
            if err:
                self.close()
                raise RuntimeError(f"TP 2 job {job!r} failed on rank {rank}:\n{err}")
            done += 1
        return torch.load(out)

    def close(self):
        for q in self.jobs:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


_RANKS = []


def _run_tp2(job, tmp_path):
    """Run `job` on two TP ranks (gloo) and return rank 0's result; the ranks are kept for the next
    job of this process."""
    if not (_RANKS and _RANKS[0].alive()):
        _RANKS[:] = [_TP2Ranks()]
    return _RANKS[0].run(job, tmp_path / 'tp2.pt')


def _batch():
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (12, 7, 10)]
    return mb.right_pad(seqs, masks=[[0] * 4 + [1] * (len(s) - 4) for s in seqs])


# 511 is padded to 512 at TP 2
TP_CONFIGS = {
    'qwen3': lambda: tiny_qwen3(),
    'llama': lambda: tiny_llama(),
    'llama-tied': lambda: tiny_llama(tied=True),
    'qwen3-vocab511': lambda: tiny_qwen3(vocab_size=511),
}


def _job_logits(name):
    cfg, b = TP_CONFIGS[name](), _batch()
    hf = hf_model(cfg)
    be = mb.MegatronBackend(hf, tp=2, head_chunk=4)
    assert (
        be.parallel.tp == 2
        and be._output_weight().shape[0] == mb.padded_vocab(cfg.vocab_size, 2) // 2
    )
    with torch.no_grad():
        ref = hf(input_ids=b['input_ids'], attention_mask=b['attention_mask']).logits
        lg = be.logits(b['input_ids'])
        d_logits = (lg - ref)[b['attention_mask'].bool()].abs().max().item()
        d_logp = (be.logprobs(b) - hf_logprobs(hf, b)).abs().max().item()
    return dict(shape=tuple(lg.shape), d_logits=d_logits, d_logp=d_logp)


@pytest.mark.parametrize('name', list(TP_CONFIGS))
def test_tp2_logits_match_hf(name, tmp_path):
    import functools

    r = _run_tp2(functools.partial(_job_logits, name), tmp_path)
    print(f"TP 2 {name}: max|logits diff| {r['d_logits']:.2e}, max|logp diff| {r['d_logp']:.2e}")
    assert r['shape'] == (3, 12, TP_CONFIGS[name]().vocab_size)
    assert r['d_logits'] < 1e-4 and r['d_logp'] < 1e-4


def _job_roundtrip():
    res = {}
    for name in ('qwen3', 'llama-tied', 'qwen3-vocab511'):
        cfg = TP_CONFIGS[name]()
        hf = hf_model(cfg)
        be = mb.MegatronBackend(hf, tp=2)
        sd, rt = hf.state_dict(), be.hf_state_dict()
        res[name] = set(rt) == set(sd) and all(torch.equal(rt[k], sd[k]) for k in sd)
    return res


def test_tp2_roundtrip_is_bit_exact(tmp_path):
    assert _run_tp2(_job_roundtrip, tmp_path) == {
        'qwen3': True,
        'llama-tied': True,
        'qwen3-vocab511': True,
    }


ADV = torch.tensor([1.0, -0.5, 0.25])


def _job_step(tp, name, grad_clip):
    b = _batch()
    be = mb.MegatronBackend(
        hf_model(TP_CONFIGS[name]()),
        optimizer='sgd',
        lr=0.5,
        grad_clip=grad_clip,
        head_chunk=4,
        tp=tp,
    )
    loss, norm = be.train_step(lambda m: pg_loss(m.logprobs(b), b, ADV))
    return dict(loss=loss, norm=norm, sd=cpu(be.hf_state_dict()))


@pytest.mark.parametrize('name, grad_clip', [('qwen3', None), ('qwen3', 0.5), ('llama-tied', 0.5)])
def test_tp2_sgd_step_matches_tp1(name, grad_clip, tmp_path):
    """One SGD step on the same rows at TP 2 and at TP 1 (this process): same loss, pre-clip norm
    and weights."""
    import functools

    r2 = _run_tp2(functools.partial(_job_step, 2, name, grad_clip), tmp_path)
    r1 = _job_step(1, name, grad_clip)
    dw = max((r2['sd'][k] - v).abs().max().item() for k, v in r1['sd'].items())
    print(
        f"TP 2 vs TP 1 ({name}, clip {grad_clip}): loss {r2['loss']:.6f}/{r1['loss']:.6f} norm "
        f"{r2['norm']:.6f}/{r1['norm']:.6f} max|dw| {dw:.1e}"
    )
    assert abs(r2['loss'] - r1['loss']) < 1e-5 and abs(r2['norm'] - r1['norm']) < 1e-4
    if grad_clip:
        assert r1['norm'] > grad_clip  # clipping was active
    assert set(r2['sd']) == set(r1['sd']) and dw < 1e-5


def _job_export(out_dir):
    b = _batch()
    be = mb.MegatronBackend(hf_model(tiny_qwen3()), optimizer='sgd', lr=0.5, tp=2)
    be.step(pg_loss(be.logprobs(b), b, ADV))
    be.save_hf(out_dir)
    with torch.no_grad():
        return dict(logits=be.logits(b['input_ids']))


def test_tp2_export_reloads_with_transformers(tmp_path):
    import functools

    r = _run_tp2(functools.partial(_job_export, str(tmp_path / 'hf')), tmp_path)
    re = (
        AutoModelForCausalLM.from_pretrained(tmp_path / 'hf', attn_implementation='eager')
        .float()
        .eval()
    )
    with torch.no_grad():
        d = (re(input_ids=_batch()['input_ids']).logits - r['logits']).abs().max().item()
    assert d < 1e-4


# ---- batch.attention='sdpa': the local spec with SDPACoreAttention, padded and packed, against the
# local spec ----


def _attention_paths(b, tp=1, recompute='none'):
    """Log-probs and fp32 main grads of one backward on the same rows: the local spec, sdpa on
    padded rows, sdpa on packed rows."""
    out = {}
    for att, pack in (('local', True), ('sdpa', False), ('sdpa', True)):
        be = mb.MegatronBackend(
            hf_model(tiny_qwen3()),
            attention=att,
            pack_rows=pack,
            head_chunk=4,
            tp=tp,
            recompute=recompute,
        )
        assert be.attention == att and be.packed_calls == 0
        lp = be.logprobs(b)
        be.backward(pg_loss(lp, b, ADV))
        assert be.packed_calls == (att == 'sdpa' and pack), (
            'rows of different lengths run packed exactly when asked'
        )
        out[(att, pack)] = dict(
            logp=lp.detach().cpu(),
            grads={n: p.main_grad.detach().cpu().clone() for n, p in be.model.named_parameters()},
        )
    return out


def _check_paths(out, where):
    ref = out[('local', True)]
    for k in (('sdpa', False), ('sdpa', True)):
        dl = (out[k]['logp'] - ref['logp']).abs().max().item()
        dg = max((out[k]['grads'][n] - g).abs().max().item() for n, g in ref['grads'].items())
        print(f"{where} sdpa pack={k[1]} vs local: max|dlogp| {dl:.1e}, max|dgrad| {dg:.1e}")
        assert dl < 1e-5 and dg < 1e-6
    assert max(g.abs().max().item() for g in ref['grads'].values()) > 1e-3


@pytest.mark.parametrize('recompute', ['none', 'full'])
def test_sdpa_matches_the_local_spec(recompute, batch):
    """fp32, TP 1: SDPA's log-probs and gradients equal the local spec's, padded or packed, with and
    without recompute."""
    _check_paths(_attention_paths(batch, recompute=recompute), f'TP 1 recompute={recompute}')


def test_sdpa_padding_never_changes_a_real_position(batch):
    """A row alone and the same row right-padded among longer ones: the same log-probs, packed or
    not."""
    for pack in (False, True):
        be = mb.MegatronBackend(hf_model(tiny_qwen3()), attention='sdpa', pack_rows=pack)
        with torch.no_grad():
            full = be.logprobs(batch).cpu()
            one = be.logprobs({k: v[1:2, :7] for k, v in batch.items()}).cpu()
        assert torch.equal(batch['attention_mask'][1, 7:], torch.zeros(5, dtype=torch.long))
        assert (full[1, :7] - one[0]).abs().max() < 1e-6 and full[1, 7:].abs().max() == 0


def test_sdpa_calls_the_fused_kernel_with_4d_grouped_inputs(batch, monkeypatch):
    """What lets torch pick a fused CUDA kernel: 4-D [batch, heads, seq, head_dim] inputs, grouped
    keys as they are, causal; packed: one call per row and layer."""
    calls, real = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.dim(), q.shape[:2], k.shape[1], kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, 'scaled_dot_product_attention', spy)
    for pack, shapes in ((True, [(1, 4)] * 3), (False, [(3, 4)])):
        calls.clear()
        be = mb.MegatronBackend(hf_model(tiny_qwen3()), attention='sdpa', pack_rows=pack)
        with torch.no_grad():
            be.logprobs(batch)
        # 2 layers; packed: the 3 rows one at a time
        assert [tuple(c[1]) for c in calls] == shapes * 2
        assert all(
            d == 4 and kv == 2 and kw['is_causal'] and kw['enable_gqa'] and 'attn_mask' not in kw
            for d, _, kv, kw in calls
        )


def _job_attention_paths():
    return _attention_paths(_batch(), tp=2)


def test_tp2_sdpa_matches_the_local_spec(tmp_path):
    """fp32, TP 2 (two spawned gloo ranks, heads and key-value groups split): rank 0's log-probs and
    gradient shards equal the local spec's."""
    _check_paths(_run_tp2(_job_attention_paths, tmp_path), 'TP 2')


# ---- the recipe's precision and memory layout: bf16 + fp32 main grads, megatron DDP, recompute,
# reference, shards ----


def _main_params(be):
    "The CPU stand-in's fp32 main params by (model) parameter name."
    return {n: m.detach().clone() for (n, _), m in zip(be.optimizer.named, be.optimizer.main)}


def test_bf16_step_with_fp32_main_grads_matches_fp32_step(batch):
    """One SGD step in bf16 (fp32 main grads and main params) against the same step in fp32, from
    weights both can hold.

        Tolerances: bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 0.2% per op), so the loss
        may differ by 1e-3 relative, the gradient norm by 5e-3 relative and the update (main params
        after - before) by 3% of its norm (measured here: 2e-4, 6e-4 and 1.1%)."""
    adv = torch.tensor([1.0, -0.5, 0.25])
    hf = hf_model(tiny_qwen3())
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    runs = {}
    for dt in (torch.float32, torch.bfloat16):
        import copy

        be = mb.MegatronBackend(
            copy.deepcopy(hf).to(dt),
            optimizer='sgd',
            lr=0.5,
            grad_clip=None,
            dtype=dt,
            head_chunk=4,
        )
        assert be.model.decoder.layers[0].self_attention.linear_qkv.weight.dtype == dt
        assert all(p.main_grad.dtype == torch.float32 for p in be.model.parameters()), (
            'fp32 gradient buffers'
        )
        before = _main_params(be)
        loss, norm = be.train_step(lambda m: pg_loss(m.logprobs(batch), batch, adv))
        after = _main_params(be)
        assert all(m.dtype == torch.float32 for m in after.values())
        for n, p in be.model.named_parameters():
            assert torch.equal(p.detach(), after[n].to(p.dtype)), n  # model = main, cast
        runs[dt] = (loss, norm, {n: after[n] - before[n] for n in after})
    (l32, n32, u32), (l16, n16, u16) = runs[torch.float32], runs[torch.bfloat16]
    err = (
        sum((u16[k] - u32[k]).pow(2).sum() for k in u32).sqrt()
        / sum(u.pow(2).sum() for u in u32.values()).sqrt()
    )
    print(
        f'bf16 vs fp32: loss {l16:.6f}/{l32:.6f}, norm {n16:.5f}/{n32:.5f}, relative update error '
        f'{err:.2e}'
    )
    assert abs(l16 - l32) < 1e-3 * abs(l32) and abs(n16 - n32) < 5e-3 * n32 and err < 0.03


def test_fp32_main_params_keep_updates_below_bf16_resolution(batch):
    """At a tiny learning rate the bf16 weights cannot move, the fp32 main params do: what the main
    copy is for."""
    adv = torch.tensor([1.0, -0.5, 0.25])
    be = mb.MegatronBackend(
        hf_model(tiny_qwen3()).to(torch.bfloat16),
        optimizer='sgd',
        lr=1e-6,
        grad_clip=None,
        dtype=torch.bfloat16,
    )
    w = be.model.decoder.layers[0].mlp.linear_fc1.weight
    before, main0 = w.detach().clone(), _main_params(be)['decoder.layers.0.mlp.linear_fc1.weight']
    be.step(pg_loss(be.logprobs(batch), batch, adv))
    main1 = _main_params(be)['decoder.layers.0.mlp.linear_fc1.weight']
    assert (main1 != main0).float().mean() > 0.5 and (w.detach() != before).float().mean() < 0.01


@pytest.mark.parametrize('mode', ['selective', 'full'])
def test_recompute_gives_the_gradients_of_no_recompute(mode, batch):
    """Activation recompute (with the CPU RNG-state shim) changes memory, not numbers: the same fp32
    main grads."""
    adv = torch.tensor([1.0, -0.5, 0.25])
    grads = {}
    for m in ('none', mode):
        be = mb.MegatronBackend(hf_model(tiny_qwen3()), recompute=m, head_chunk=4)
        tc = be.model.config
        assert (tc.recompute_granularity, tc.recompute_num_layers) == {
            'none': (None, None),
            'selective': ('selective', None),
            'full': ('full', 1),
        }[m]
        be.backward(pg_loss(be.logprobs(batch), batch, adv))
        grads[m] = {n: p.main_grad.clone() for n, p in be.model.named_parameters()}
        be.optimizer.zero_grad()
    d = max((grads[mode][k] - g).abs().max().item() for k, g in grads['none'].items())
    print(f'recompute {mode}: max|grad diff| {d:.1e}')
    assert d < 1e-6 and max(g.abs().max().item() for g in grads['none'].values()) > 1e-3


def test_layout_refusals_are_clear():
    hf = hf_model(tiny_qwen3())
    with pytest.raises(
        ValueError,
        match=r'cfg\.batch\.sequence_parallel=True needs the Transformer Engine layer spec',
    ):
        # refused before any group or model is built
        mb.MegatronBackend(hf, tp=2, sequence_parallel=True)
    if not mb.have_transformer_engine():
        with pytest.raises(
            ImportError, match=r"cfg\.batch\.attention='te' needs Transformer Engine"
        ):
            mb.MegatronBackend(hf, attention='te')
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r'cfg\.batch\.distributed_optimizer=True needs'):
            mb.MegatronBackend(hf, distributed_optimizer=True)
    with pytest.raises(ValueError, match=r'cfg\.batch\.recompute'):
        mb.MegatronBackend(hf, recompute='everything')


def test_cpu_stand_in_refuses_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    with pytest.raises(RuntimeError, match='CPU stand-in'):
        mb.CpuMainParamOptimizer(None, None, None)


def test_optimizer_state_restores_fp32_main_params(batch):
    """A checkpoint (bf16 weights + this rank's optimizer state) resumes the fp32 main params
    exactly: the next step is identical."""
    from memagent.config import get_preset

    cfg = get_preset('tiny', {'model.dtype': 'bfloat16', 'optim.lr': 1e-3})
    adv = torch.tensor([1.0, -0.5, 0.25])
    a = mb.MegatronBackend.from_config(cfg, hf_model(tiny_qwen3()).to(torch.bfloat16))
    assert (
        a.model.decoder.layers[0].mlp.linear_fc1.weight.dtype == torch.bfloat16 and a.state_key == 0
    )
    a.step(pg_loss(a.logprobs(batch), batch, adv))
    import copy

    # as written to disk
    weights, state = (
        {k: v.clone() for k, v in a.hf_state_dict().items()},
        copy.deepcopy(a.state_dict()),
    )
    b = mb.MegatronBackend.from_config(cfg, hf_model(tiny_qwen3(), seed=5).to(torch.bfloat16))
    b.load_state_dict(weights, state)
    assert all(torch.equal(_main_params(a)[k], v) for k, v in _main_params(b).items())
    for be in (a, b):
        be.step(pg_loss(be.logprobs(batch), batch, adv))
    sa, sb = a.hf_state_dict(), b.hf_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- checkpoints before any optimizer step: a named marker instead of megatron-core's (asserting)
# state_dict ----


def test_checkpoint_before_any_step_saves_a_marker_and_resumes_fresh(tmp_path, batch):
    """The policy group's state before a step is the marker; save_checkpoint writes it,
    load_checkpoint names it, a resumed group starts a fresh optimizer."""
    from memagent.config import get_preset
    from memagent.policy import LocalGroup
    from memagent import checkpoint as ckpt

    cfg = get_preset('tiny', {'backend': 'megatron', 'optim.lr': 1e-3, 'optim.warmup_steps': 2})
    adv = torch.tensor([1.0, -0.5, 0.25])
    g = LocalGroup(cfg, pad_id=0)
    key, st = g.policy.state_key, g.state_dict()
    assert ckpt.no_optimizer_state_reason(st['shards'][key]['optimizer']) == mb.NO_STEP_REASON
    assert 'DistributedOptimizer.state_dict() asserts' in mb.NO_STEP_REASON
    path = ckpt.save_checkpoint(tmp_path, 0, g.hf_state_dict(), st, {'metrics': None}, 'x: 1\n', {})
    ck = ckpt.load_checkpoint(path)
    assert ck['no_optimizer_state'] == {key: mb.NO_STEP_REASON}
    g2 = LocalGroup(cfg, pad_id=0)
    with pytest.warns(UserWarning, match='starting a fresh optimizer: no optimizer step taken yet'):
        g2.load_state_dict(ck['model'], ck['optimizer'])
    opt = g2.policy.optimizer
    assert opt.fresh_reason == mb.NO_STEP_REASON and opt.steps_taken == 0
    # a fresh optimizer IS the state of one that has not stepped: the next step is identical
    for be in (g.policy, g2.policy):
        be.step(pg_loss(be.logprobs(batch), batch, adv))
    sa, sb = g.policy.hf_state_dict(), g2.policy.hf_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    real = g2.policy.state_dict()
    assert (
        ckpt.no_optimizer_state_reason(real['optimizer']) is None
        and real['optimizer']['steps_taken'] == 1
    )
    # where a real state is expected the marker is refused, naming why
    with pytest.raises(
        ValueError, match='has taken 1 steps: loading it would drop their Adam moments'
    ):
        g2.policy.load_state_dict(sa, st['shards'][key])
    with pytest.raises(ValueError, match="scheduler's state counts 3 updates"):
        LocalGroup(cfg, pad_id=0).policy.load_state_dict(
            sa,
            {
                'optimizer': ckpt.no_optimizer_state(mb.NO_STEP_REASON),
                'scheduler': {'last_step': 3, 'base_lrs': [1e-3]},
            },
        )
    later = ckpt.save_checkpoint(
        tmp_path, 1, sa, st, {'metrics': {'step': 1, 'optimizer_steps': 1}}, 'x: 1\n', {}
    )
    with pytest.raises(ckpt.CheckpointError, match="the checkpoint's step took 1 optimizer steps"):
        ckpt.load_checkpoint(later)
    # a real state round-trips its step count: a checkpoint after a resume is not mistaken for one
    # before any step
    g3 = LocalGroup(cfg, pad_id=0)
    g3.load_state_dict(sb, {'shards': {key: real}})
    assert (
        g3.policy.optimizer.steps_taken == 1
        and ckpt.no_optimizer_state_reason(g3.policy.state_dict()['optimizer']) is None
    )


def test_megatron_core_optimizer_does_not_call_megatron_core_before_a_step(monkeypatch):
    """MegatronCoreOptimizer (GPU only) takes the marker path with no step taken: megatron-core's
    state_dict, which asserts then, is never called."""
    import megatron.core.optimizer as mo
    from memagent.config import OptimCfg
    from memagent import checkpoint as ckpt

    calls = []

    class Inner:
        """megatron-core's optimizer as far as these calls go; state_dict asserts as
        DistributedOptimizer's does before a step."""

        param_groups = [{'lr': 1e-3}]

        def state_dict(self):
            calls.append('state_dict')
            raise AssertionError('assert len(steps) == 1')

        def step_with_ready_grads(self):
            calls.append('step')
            return True

        def reload_model_params(self):
            calls.append('reload')

        def load_state_dict(self, sd):
            calls.append('load')

    monkeypatch.setattr(mo, 'get_megatron_optimizer', lambda *a, **k: Inner())
    model = mb.build_gpt_model(tiny_qwen3())
    opt = mb.MegatronCoreOptimizer(model, mb.wrap_ddp(model), OptimCfg(name='adam', lr=1e-3), 1.0)
    marker = opt.state_dict()
    assert ckpt.no_optimizer_state_reason(marker) == mb.NO_STEP_REASON and calls == []
    with pytest.warns(UserWarning, match='fresh optimizer'):
        opt.load_state_dict(marker)
    assert calls == ['reload'] and opt.fresh_reason == mb.NO_STEP_REASON and opt.steps_taken == 0
    opt.step()
    assert opt.steps_taken == 1
    with pytest.raises(AssertionError, match=r'len\(steps\) == 1'):
        opt.state_dict()  # after a step it does ask megatron-core
    with pytest.raises(ValueError, match='has taken 1 steps'):
        opt.load_state_dict(marker)
    assert calls == ['reload', 'step', 'state_dict']


def test_megatron_core_optimizer_loads_shard_states_into_views_of_fp32_parameters(monkeypatch):
    """The first GPU run stopped here: megatron-core's DistributedOptimizer keeps an fp32
    parameter's main shard as a view of
        the parameter (`model_param.view(-1)[start:end]`) and `_set_main_param_and_optimizer_states`
        copies the saved values
        into it in place; with autograd on, torch refuses an in-place write into a view of a leaf
        that
        requires grad.
        megatron-core's optimizer needs CUDA: a stand-in subclass keeps its main shards the way
        megatron
        does."""
    import megatron.core.optimizer as mo
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from memagent.config import OptimCfg

    class Shards(DistributedOptimizer):
        """megatron-core's distributed optimizer as far as the state load goes: main shards are
        views of fp32 parameters."""

        def __init__(
            self, params
        ):  # megatron's own constructor allocates CUDA buffers; only what the load touches
            self.params = params
            # the shard this rank owns: a view, as megatron's
            self.main = {p: p.view(-1)[1:3] for p in params}
            self.exp_avg = {p: torch.zeros(2) for p in params}
            self.gbuf_ranges = [
                {(torch.float32, torch.float32): [{'param_map': {p: None for p in params}}]}
            ]
            self.common = None

        def load_state_dict(self, sd):
            self.common = sd

        def _set_main_param_and_optimizer_states(self, p, tensors):
            self.main[p].copy_(tensors['param'])
            self.exp_avg[p].copy_(tensors['exp_avg'])

    model = mb.build_gpt_model(tiny_qwen3())
    params = [p for p in model.parameters() if p.requires_grad][:3]
    assert all(p.dtype == torch.float32 and p.is_leaf for p in params)
    monkeypatch.setattr(mo, 'get_megatron_optimizer', lambda *a, **k: Shards(params))
    opt = mb.MegatronCoreOptimizer(model, mb.wrap_ddp(model), OptimCfg(name='adam', lr=1e-3), 1.0)
    state = [
        {'param': torch.tensor([7.0, 8.0]), 'exp_avg': torch.tensor([0.5, 0.25])} for _ in params
    ]
    opt.load_state_dict(
        {'megatron_core': [{'common': {'step': 3}, 'param_state': state}], 'steps_taken': 3}
    )
    inner = opt.parts[0]
    assert inner.common == {'step': 3} and opt.steps_taken == 3
    for p in params:
        assert (
            p.view(-1)[1:3].tolist() == [7.0, 8.0]
            and inner.exp_avg[p].tolist() == [0.5, 0.25]
            and p.requires_grad
        )
    assert torch.is_grad_enabled()


def test_bf16_policy_keeps_every_parameter_in_bf16(tmp_path, batch):
    """The chosen rule: every parameter of a bf16 model is bf16, the local spec's norms too (their
    fp32 copy is the optimizer's main param); the HF export is bf16 throughout."""
    from memagent.config import get_preset
    from safetensors import safe_open

    cfg = get_preset('tiny', {'backend': 'megatron', 'model.dtype': 'bfloat16'})
    be = mb.MegatronBackend.from_config(cfg, hf_model(tiny_qwen3()).to(torch.bfloat16))
    norms = [n for n, p in be.model.named_parameters() if 'norm' in n]
    # input, pre-MLP, q and k norms per layer; the final one
    assert len(norms) == 2 * 4 + 1 and be.attention == 'local'
    assert {p.dtype for p in be.model.parameters()} == {torch.bfloat16}
    # the fp32 master copy lives in the optimizer
    assert {m.dtype for m in be.optimizer.main} == {torch.float32}
    assert {v.dtype for v in be.hf_state_dict().values()} == {torch.bfloat16}
    out = be.save_hf(tmp_path / 'hf', tokenizer=_tiny_tokenizer())
    with safe_open(str(out / 'model.safetensors'), 'pt') as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {'BF16'}


def test_reference_from_config_is_frozen(batch):
    from memagent.config import get_preset

    cfg = get_preset('tiny', {'model.dtype': 'bfloat16'})
    hf = hf_model(tiny_qwen3()).to(torch.bfloat16)
    ref = mb.MegatronBackend.reference_from_config(cfg, hf)
    assert ref.optimizer is None and ref.ddp is None and not ref.model.training
    # the norms too
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in ref.model.parameters())
    assert ref.model.decoder.layers[0].self_attention.linear_qkv.weight.dtype == torch.bfloat16
    with torch.no_grad():
        d = (
            (
                ref.logprobs(batch, 0.7).cpu()
                - mb.MegatronBackend(hf, dtype=torch.bfloat16).logprobs(batch, 0.7).cpu()
            )
            .abs()
            .max()
        )
    assert d == 0, 'the reference computes what the policy computes on the same weights'
    with pytest.raises(RuntimeError, match='frozen reference'):
        ref.step()
    ref.close()
    assert mb.init_parallel(1, 1).world_size == 1, (
        'closing a reference leaves the parallel groups to the policy'
    )


# ---- DP 2 (two processes, TP 1) and TP 2 reference ----


def _job_dp2_sum_and_shards():
    """Rank r of DP 2 takes its share of the rows; returns its step result and the distributed
    optimizer's shard sizes."""
    import torch.distributed as dist

    b, rank = _batch(), int(__import__('os').environ['RANK'])
    rows = [[0, 1], [2]][rank]
    m = (b['response_mask'] * b['attention_mask']).float()
    m[:, 0] = 0
    be = mb.MegatronBackend(
        hf_model(tiny_qwen3()), optimizer='sgd', lr=0.5, grad_clip=None, head_chunk=4
    )
    assert (be.dp_size, be.dp_rank, be.state_key, be.row_source) == (2, rank, 0, True)
    sub = {k: v[rows] for k, v in b.items()}
    # this rank's share of the step loss
    loss = -((ADV[rows][:, None] * be.logprobs(sub)) * m[rows]).sum() / m.sum()
    norm = be.step(loss)
    # distributed-optimizer shard sizes: the function (megatron's range maps, every DP rank
    # evaluated here) against megatron's range maps on this rank's real DP group
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    res = {}
    for name, cfg in (
        ('qwen3-tied', tiny_qwen3(tied=True)),
        (
            'llama-odd',
            tiny_llama(hidden_size=40, num_attention_heads=4, intermediate_size=72, vocab_size=503),
        ),
    ):
        ddp = mb.wrap_ddp(
            mb.build_gpt_model(cfg, dtype=torch.bfloat16), use_distributed_optimizer=True
        )
        got = mb.distributed_optimizer_shard_numels(ddp)
        own = sum(
            len(rg['param'])
            for buf in ddp.buffers
            for maps in DistributedOptimizer._build_gbuf_range_map(buf).values()
            for bm in maps
            for rg in bm['param_map'].values()
        )
        owns = [None, None]
        dist.all_gather_object(owns, own)
        res[name] = dict(got=got, owns=owns, params=sum(p.numel() for p in ddp.module.parameters()))
    return dict(norm=norm, sd=cpu(be.hf_state_dict()), shards=res)


def test_dp2_megatron_ddp_sums_gradients_and_shards_match_megatron(tmp_path):
    """DP 2 through megatron-core's DDP over gloo gives the DP 1 step (gradients summed, not
    averaged); shard sizes equal megatron's own."""
    r2 = _run_tp2(_job_dp2_sum_and_shards, tmp_path)
    r1 = _job_step(1, 'qwen3', None)
    dw = max((r2['sd'][k] - v).abs().max().item() for k, v in r1['sd'].items())
    print(f"DP 2 vs DP 1: norm {r2['norm']:.6f}/{r1['norm']:.6f}, max|dw| {dw:.1e}")
    assert abs(r2['norm'] - r1['norm']) < 1e-4 and dw < 1e-5
    for name, r in r2['shards'].items():
        g = r['got']
        print(name, g)
        assert g['shard_numel'] == r['owns'], (
            'every rank evaluated by the function = megatron on that rank'
        )
        assert (g['dp'], g['param_numel'], sum(g['shard_numel'])) == (2, r['params'], r['params'])
        assert (
            g['grad_buffer_numel'] == 2 * g['shard_slot_numel']
            and g['grad_buffer_numel'] % 128 == 0
        )
        assert g['grad_buffer_bytes'] == 4 * g['grad_buffer_numel'], 'fp32 gradient buffers'
        # equal slots; padding decides the rest
        assert all(0 < s <= g['shard_slot_numel'] for s in g['shard_numel'])
    # every parameter is bf16 (the norms too): one buffer, and without a bucket size (overlap off)
    # one bucket
    assert r2['shards']['qwen3-tied']['got']['buckets'] == 1


def _job_reference_tp2():
    from memagent.config import get_preset

    cfg = get_preset('tiny', {'batch.tp': 2, 'batch.n_gpus': 2})
    b, hf = _batch(), hf_model(tiny_qwen3(vocab_size=511))
    pol = mb.MegatronBackend.from_config(cfg, hf)
    ref = mb.MegatronBackend.reference_from_config(cfg, hf)
    assert ref.parallel.tp == 2 and ref._output_weight().shape == pol._output_weight().shape == (
        256,
        64,
    )
    assert ref.optimizer is None and not any(p.requires_grad for p in ref.model.parameters())
    with torch.no_grad():
        d = (ref.logprobs(b, 0.7) - hf_logprobs_t(hf, b, 0.7)).abs().max().item()
    return dict(
        d=d,
        own=sum(p.numel() for p in ref.model.parameters()),
        full=sum(p.numel() for p in hf.parameters()),
    )


def hf_logprobs_t(model, batch, temperature):
    logits = (
        model(input_ids=batch['input_ids'], attention_mask=batch['attention_mask']).logits.float()
        / temperature
    )
    out = torch.zeros(batch['input_ids'].shape)
    out[:, 1:] = (
        logits[:, :-1].log_softmax(-1).gather(-1, batch['input_ids'][:, 1:, None]).squeeze(-1)
    )
    want = batch['attention_mask'].bool() & batch['response_mask'].bool()
    want[:, 0] = False
    return out * want


def test_tp2_reference_logprobs_match_hf(tmp_path):
    "The frozen reference at TP 2: each rank holds its shard only, and the log-probs match HF's."
    r = _run_tp2(_job_reference_tp2, tmp_path)
    print(f"TP 2 reference: max|logp diff| {r['d']:.2e}, params per rank {r['own']} of {r['full']}")
    assert r['d'] < 1e-4 and r['own'] < 0.6 * r['full']
