"""The weight check after a sync (`memagent.runcheck.weight_check`): the engine's teacher-forced
prompt log-probs against the
trainer's. It passes after a real sync on CPU (fp32, tiny Qwen3, max |dlogp| <= 1e-5), through
SGLang's schema (the local
schema server backed by the in-process engine) and in process, and it fails when the sync did
nothing, reached one server
of two, or delivered other weights: before this check, each of those syncs returned without an error
and the run went on."""

from types import SimpleNamespace

import pytest
import requests
import torch

from memagent.engines import (
    DeterministicEngineError,
    HFEngine,
    SamplingParams,
    SGLangEngine,
    teacher_forced_logprobs,
)
from memagent.models import load_model, load_tokenizer
from memagent.runcheck import (
    Gates,
    KL_TOL,
    WEIGHT_PROMPT,
    WEIGHT_TOL,
    kl_gate,
    trainer_logprobs,
    weight_check,
    weight_gate,
    weight_prompt_ids,
)
from memagent.testing import FakeSGLangServer
from memagent.checkpoint import push_weights

TOL = WEIGHT_TOL['cpu-fp32']


@pytest.fixture(scope='module')
def tok():
    return load_tokenizer('tiny-qwen3')


@pytest.fixture(scope='module')
def ids(tok):
    return weight_prompt_ids(tok)


def trained(seed: int = 0, scale: float = 1e-2):
    """A tiny Qwen3 whose weights moved as a training step would move them (every tensor plus seeded
    noise)."""
    m = load_model('tiny-qwen3')
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return m


def policy_side(model):
    "The trainer's side: teacher-forced log-probs of ids[1:] under `model`."

    def f(ids):
        with torch.no_grad():
            return teacher_forced_logprobs(model, ids[:1], ids[1:]).tolist()

    return f


def sd_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def client(*servers):
    return SGLangEngine([s.url for s in servers], timeout_s=60, max_retries=0)


def test_the_prompt_is_fixed_and_tokenized(tok, ids):
    assert ids == tok(WEIGHT_PROMPT, add_special_tokens=False)['input_ids'] and len(ids) >= 8
    assert WEIGHT_TOL == {'cpu-fp32': 1e-5, 'gpu-bf16': 5e-2} and KL_TOL == {
        'cpu-fp32': 0.0,
        'gpu-bf16': 1e-6,
    }


def test_passes_after_a_real_sync_through_the_schema_server(tmp_path, tok, ids):
    policy = trained()
    with FakeSGLangServer(engine=HFEngine(load_model('tiny-qwen3'), tok)) as srv:
        cl = client(srv)
        before = weight_check(cl, policy_side(policy), ids, TOL)
        # the server still holds the base weights
        assert not before['passed'] and before['max_abs_dlogp'] > 1e-3
        # HF directory + /update_weights_from_disk
        push_weights(cl, sd_of(policy), policy, tok, tmp_path / 'sync')
        r = weight_check(cl, policy_side(policy), ids, TOL, previous=before)
        assert r['passed'] and r['max_abs_dlogp'] <= 1e-5, r['per_server']
        assert (r['servers'], r['prompt_tokens'], r['stale_servers']) == (1, len(ids), []) and r[
            'engine_moved'
        ][0] > 1e-3
        body = srv.calls[-1]
        assert (
            body['input_ids'],
            body['return_logprob'],
            body['logprob_start_len'],
            body['top_logprobs_num'],
        ) == (ids, True, 0, 0)
        cl.close()


def test_a_sync_that_did_nothing_fails(tmp_path, tok, ids):
    # the server acknowledges /update_weights_from_disk and loads nothing: the sync returns without
    # an error
    policy = trained()
    with FakeSGLangServer(engine=HFEngine(load_model('tiny-qwen3'), tok)) as srv:
        srv.routes[('POST', '/update_weights_from_disk')] = lambda ex: setattr(
            ex, 'reply', {'success': True, 'message': 'ok'}
        )
        cl = client(srv)
        base = weight_check(cl, policy_side(load_model('tiny-qwen3')), ids, TOL)
        assert base['passed']  # the initial weights agree
        push_weights(cl, sd_of(policy), policy, tok, tmp_path / 'sync')  # "succeeds"
        r = weight_check(cl, policy_side(policy), ids, TOL, previous=base)
        assert not r['passed'] and r['max_abs_dlogp'] > 1e-3
        assert (
            r['stale_servers'] == [0] and r['engine_moved'] == [0.0] and r['trainer_moved'] > 1e-3
        )
        cl.close()


def test_a_sync_that_missed_one_server_of_two_fails(tmp_path, tok, ids):
    policy = trained()
    with (
        FakeSGLangServer(engine=HFEngine(load_model('tiny-qwen3'), tok)) as a,
        FakeSGLangServer(engine=HFEngine(load_model('tiny-qwen3'), tok)) as b,
    ):
        b.routes[('POST', '/update_weights_from_disk')] = lambda ex: setattr(
            ex, 'reply', {'success': True, 'message': 'ok'}
        )
        cl = client(a, b)
        push_weights(cl, sd_of(policy), policy, tok, tmp_path / 'sync')
        r = weight_check(cl, policy_side(policy), ids, TOL)
        assert (
            r['servers'] == 2
            and r['per_server'][0] <= 1e-5 < 1e-3 < r['per_server'][1]
            and not r['passed']
        )
        cl.close()


def test_a_perturbed_state_dict_fails(tok, ids):
    # the sync delivered other weights than the trainer's: one tensor off by a little
    policy = trained()
    eng = HFEngine(load_model('tiny-qwen3'), tok)
    sd = sd_of(policy)
    k = next(k for k in sd if 'layers.0.mlp.down_proj' in k)
    sd[k] = sd[k] + 1e-3 * torch.randn(sd[k].shape, generator=torch.Generator().manual_seed(1))
    eng.sync_weights(sd)
    r = weight_check(eng, policy_side(policy), ids, TOL)
    assert not r['passed'] and TOL < r['max_abs_dlogp'] < 1.0
    eng.sync_weights(sd_of(policy))  # the right weights
    assert weight_check(eng, policy_side(policy), ids, TOL)['max_abs_dlogp'] <= 1e-5


def test_in_process_engine_is_exact_after_a_sync(tok, ids):
    policy = trained()
    eng = HFEngine(load_model('tiny-qwen3'), tok)
    eng.sync_weights(sd_of(policy))
    r = weight_check(eng, policy_side(policy), ids, TOL)
    assert r['passed'] and r['max_abs_dlogp'] == 0.0
    # values instead of a function; a wrong count is refused, not compared
    assert weight_check(eng, r['trainer'], ids, TOL)['passed']
    with pytest.raises(ValueError, match='trainer log-probs for a prompt'):
        weight_check(eng, r['trainer'][1:], ids, TOL)


def test_non_finite_trainer_values_fail(tok, ids):
    eng = HFEngine(load_model('tiny-qwen3'), tok)
    want = policy_side(eng.model)(ids)
    want[3] = float('nan')
    r = weight_check(eng, want, ids, TOL)
    assert not r['passed'] and r['max_abs_dlogp'] == float('inf')


def test_trainer_side_of_a_policy_group(tok, ids):
    """The trainer's side is the policy's own forward (`group.prompt_logprobs`), torch and megatron
    backends, against the HF forward of the same weights."""
    from memagent.config import get_preset
    from memagent.policy import LocalGroup

    group = LocalGroup(get_preset('tiny'), tok.pad_token_id, 'cpu')
    with torch.no_grad():
        for p in group.policy.model.parameters():
            p.add_(1e-2)  # a step
    got = trainer_logprobs(SimpleNamespace(group=group), ids)
    assert (
        len(got) == len(ids) - 1
        and weight_check(HFEngine(group.policy.model), got, ids, TOL)['passed']
    )
    pytest.importorskip('megatron.core')
    from memagent.backends.megatron import destroy_parallel

    meg = LocalGroup(get_preset('tiny', {'backend': 'megatron'}), tok.pad_token_id)
    try:
        policy = trained()
        meg.load_state_dict(sd_of(policy), None)  # the megatron layout, other weights
        r = weight_check(
            HFEngine(policy), trainer_logprobs(SimpleNamespace(group=meg), ids), ids, TOL
        )
    finally:
        meg.close()
        destroy_parallel()
    # another implementation: rounding, within tol
    assert r['passed'] and 0 < r['max_abs_dlogp'] <= TOL, r['max_abs_dlogp']


def test_weight_gate_records_and_survives_an_engine_error(tok, ids):
    policy = trained()
    tr = SimpleNamespace(
        group=SimpleNamespace(prompt_logprobs=policy_side(policy)),
        engine=HFEngine(load_model('tiny-qwen3'), tok),
    )
    G = Gates(echo=False)
    r0 = weight_gate(G, 0, tr, ids, TOL)
    assert r0 is not None and not r0['passed']  # the engine holds the base weights
    tr.engine.sync_weights(sd_of(policy))
    assert weight_gate(G, 1, tr, ids, TOL, r0)['passed']
    with FakeSGLangServer() as bare:  # no engine behind: the request is refused
        tr.engine = SGLangEngine([bare.url], max_retries=0)
        assert weight_gate(G, 2, tr, ids, TOL) is None
        tr.engine.close()
    assert [(g['gate'], g['result']) for g in G.rows] == [
        ('weights_synced[step 0]', 'FAIL'),
        ('weights_synced[step 1]', 'PASS'),
        ('weights_synced[step 2]', 'FAIL'),
    ]
    assert (
        G.rows[1]['max_abs_dlogp'] <= 1e-5
        and G.rows[1]['stale_servers'] == []
        and 'needs a backing engine' in G.rows[2]['error']
    )


def test_kl_gate():
    cfg = SimpleNamespace(
        loss=SimpleNamespace(kl_type='low_var_kl', kl_coef=1e-3),
        optim=SimpleNamespace(mini_batches=1),
    )
    G = Gates(echo=False)
    assert kl_gate(G, [{'step': 1, 'kl': 0.0}, {'step': 2, 'kl': 3e-4}], cfg, 'cpu-fp32')
    assert not kl_gate(G, [{'step': 1, 'kl': 1e-12}], cfg, 'cpu-fp32')  # exactly 0 on CPU fp32
    assert kl_gate(G, [{'step': 1, 'kl': -8e-7}], cfg, 'gpu-bf16') and not kl_gate(
        G, [{'step': 1, 'kl': 2e-6}], cfg, 'gpu-bf16'
    )
    assert not kl_gate(G, [{'step': 1, 'kl': float('nan')}], cfg, 'gpu-bf16') and not kl_gate(
        G, [], cfg, 'cpu-fp32'
    )
    assert (
        kl_gate(
            G,
            [],
            SimpleNamespace(loss=SimpleNamespace(kl_type='none', kl_coef=0.0), optim=cfg.optim),
            'cpu-fp32',
        )
        is None
    )
    assert [g['result'] for g in G.rows] == ['PASS', 'FAIL', 'PASS', 'FAIL', 'FAIL', 'FAIL']


BAD = [
    ({'return_logprob': True, 'logprob_start_len': '0'}, 'wrong type'),
    ({'return_logprob': 1, 'logprob_start_len': 0}, 'wrong type'),
    ({'return_logprob': [True], 'logprob_start_len': 0}, 'no lists'),
    (
        {'return_logprob': True, 'logprob_start_len': 0, 'return_text_in_logprobs': 'yes'},
        'wrong type',
    ),
    (
        {'return_logprob': True, 'logprob_start_len': 99},
        'is higher than the number of input tokens',
    ),
    ({'return_logprob': True, 'logprob_start_len': -2}, 'a prompt position'),
    ({'logprob_start_len': 0}, 'without return_logprob'),
    ({'return_logprob': True, 'logprob_start_len': 0, 'top_logprobs_num': -1}, 'must be >= 0'),
    ({'return_logprob': True, 'logprob_start_len': 0, 'top_logprobs_num': 5}, 'not modelled'),
    ({'return_logprob': True, 'logprob_start_len': 2}, 'not modelled'),
    ({'return_logprob': True, 'logprob_start_len': 0, 'token_ids_logprob': [1, 2]}, 'not modelled'),
]


@pytest.fixture(scope='module')
def scored_server(tok):
    with FakeSGLangServer(engine=HFEngine(load_model('tiny-qwen3'), tok)) as s:
        yield s


@pytest.mark.parametrize('fields,why', BAD)
def test_schema_server_refuses_malformed_logprob_requests(scored_server, fields, why):
    r = requests.post(
        scored_server.url + '/generate',
        timeout=30,
        json={'input_ids': [100, 200, 300], 'sampling_params': {'max_new_tokens': 1}, **fields},
    )
    assert r.status_code == 400 and why in r.json()['error']['message'], r.text


def test_schema_server_without_an_engine_refuses_prompt_logprobs(ids):
    with FakeSGLangServer() as srv:
        r = requests.post(
            srv.url + '/generate',
            timeout=30,
            json={'input_ids': ids, 'return_logprob': True, 'logprob_start_len': 0},
        )
        assert r.status_code == 400 and 'needs a backing engine' in r.json()['error']['message']
        cl = SGLangEngine([srv.url], max_retries=0)
        with pytest.raises(DeterministicEngineError, match='needs a backing engine'):
            cl.prompt_logprobs_each(ids)
        # sampling still works without one
        assert cl.generate([ids], SamplingParams(2, seed=1))[0].output_ids
        cl.close()


def test_schema_server_answers_in_sglangs_layout(scored_server, ids):
    r = requests.post(
        scored_server.url + '/generate',
        timeout=30,
        json={
            'input_ids': ids,
            'sampling_params': {'max_new_tokens': 1, 'temperature': 0.0},
            'return_logprob': True,
            'logprob_start_len': 0,
            'top_logprobs_num': 0,
            'return_text_in_logprobs': False,
            'stream': False,
        },
    ).json()
    itl = r['meta_info']['input_token_logprobs']
    assert len(itl) == len(ids) and [e[1] for e in itl] == ids and itl[0] == [None, ids[0], None]
    assert [e[0] for e in itl[1:]] == scored_server.engine.prompt_logprobs(ids) and all(
        e[2] is None for e in itl
    )
    assert len(r['output_ids']) == 1 and r['meta_info']['prompt_tokens'] == len(ids)
