"""One model per engine, proven: an engine serving another checkpoint than the one a run is labelled
with is refused,
with both identities named, whether the served directory is visible (tensor hash) or not
(fingerprint)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memagent.checkpoint import export_hf, read_weights_record, tensors_sha256
from memagent.evaluate import ModelMismatchError, check_served_model, evaluate
from memagent.engines import HFEngine, SGLangEngine
from memagent.testing import FakeSGLangServer


@pytest.fixture(scope='module')
def two(tmp_path_factory):
    """Two exported checkpoints of the tiny model with different weights: (dir a, dir b, model a,
    model b)."""
    import torch
    from memagent.models import load_model, load_tokenizer

    d = tmp_path_factory.mktemp('ckpt')
    m, tok = load_model('tiny-qwen3'), load_tokenizer('tiny-qwen3')
    g = torch.Generator().manual_seed(0)
    other = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in m.state_dict().items()}
    a = export_hf(m, tok, d / 'a')
    b = export_hf(m, tok, d / 'b', state_dict=other)
    return a, b, load_model(str(a)), load_model(str(b))


def _client(srv):
    return SGLangEngine([srv.url], timeout_s=30, max_retries=0, connect_timeout_s=5)


def test_export_records_a_tensor_hash_that_ignores_sharding(two, tmp_path):
    a, b, ma, _ = two
    ra, rb = read_weights_record(a), read_weights_record(b)
    assert ra['tensors_sha256'] == tensors_sha256(a) != rb['tensors_sha256']
    ma.save_pretrained(tmp_path / 'sharded', max_shard_size='10MB')
    assert len(list((tmp_path / 'sharded').glob('*.safetensors'))) > 1
    assert tensors_sha256(tmp_path / 'sharded') == ra['tensors_sha256']
    assert ra['fingerprint']['output_ids'] and len(ra['fingerprint']['logprobs']) == len(
        ra['fingerprint']['output_ids']
    )


def test_server_serving_the_wrong_model_is_refused_with_both_identities(two):
    a, b, _, _ = two
    with FakeSGLangServer(model_path=str(b)) as srv:
        eng = _client(srv)
        with pytest.raises(ModelMismatchError) as e:
            check_served_model(eng, str(a))
        msg = str(e.value)
        assert f"model_path {b}" in msg and f"path {a.resolve()}" in msg, msg
        assert (
            tensors_sha256(b)[:16] in msg and read_weights_record(a)['tensors_sha256'][:16] in msg
        ), msg
        proof = check_served_model(eng, str(b))
        assert proof['servers'][0]['how'] == 'served path visible: tensor hash'
        assert proof['servers'][0]['tensors_sha256'] == read_weights_record(b)['tensors_sha256']
        # after /update_weights_from_disk the server reports the new path, as SGLang does
        eng.update_weights(path=str(a))
        assert check_served_model(eng, str(a))['servers'][0]['model_path'] == str(a)
        eng.close()


def test_evaluate_refuses_before_scoring(two):
    a, b, _, _ = two
    from memagent.config import get_preset
    from memagent.data import make_synthetic
    from memagent.models import load_tokenizer

    cfg = get_preset(
        'tiny',
        {'chunking.chunk_tokens': 32, 'chunking.memory_tokens': 4, 'chunking.final_tokens': 4},
    )
    with FakeSGLangServer(model_path=str(b)) as srv:
        eng = _client(srv)
        with pytest.raises(ModelMismatchError, match='the served weights differ'):
            evaluate(
                make_synthetic(2, num_words=20, seed=0),
                eng,
                load_tokenizer('tiny-qwen3'),
                cfg,
                model_name=str(a),
                check_model=True,
                progress=False,
            )
        assert srv.calls == []  # nothing was generated, nothing scored
        eng.close()


def test_invisible_path_is_checked_by_fingerprint(two):
    a, b, ma, mb = two
    with FakeSGLangServer(engine=HFEngine(mb), model_path='/on/another/host/b') as srv:
        eng = _client(srv)
        with pytest.raises(ModelMismatchError) as e:
            check_served_model(eng, str(a))
        msg = str(e.value)
        assert (
            'fingerprint differs' in msg
            and 'model_path /on/another/host/b' in msg
            and f"path {a.resolve()}" in msg
        ), msg
        eng.close()
    with FakeSGLangServer(engine=HFEngine(ma), model_path='/on/another/host/a') as srv:
        eng = _client(srv)
        proof = check_served_model(eng, str(a))
        assert (
            proof['servers'][0]['how'] == 'fingerprint'
            and proof['servers'][0]['max_logprob_diff'] < 1e-4
        )
        eng.close()


def test_no_fingerprint_and_no_visible_path_cannot_be_proven(two, tmp_path):
    a, _, ma, _ = two
    bare = export_hf(ma, None, tmp_path / 'bare', identity=False)
    assert read_weights_record(bare) is None
    with FakeSGLangServer(engine=HFEngine(ma), model_path='/on/another/host/a') as srv:
        eng = _client(srv)
        with pytest.raises(ModelMismatchError, match='records no fingerprint'):
            check_served_model(eng, str(bare))
        eng.close()


def test_hf_engine_identity_is_its_model_object(two):
    a, b, ma, mb = two
    eng = HFEngine(ma)
    assert check_served_model(eng, str(a))['path'] == str(a.resolve())
    with pytest.raises(ModelMismatchError, match=f"loaded from {a}"):
        check_served_model(eng, str(b))
    # weights pushed from memory: no longer the checkpoint
    eng.update_weights(state_dict=mb.state_dict())
    with pytest.raises(ModelMismatchError, match='loaded from None'):
        check_served_model(eng, str(a))
