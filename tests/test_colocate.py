"""Colocated SGLang engines: the release / sync / resume cycle against the SGLang schema server, and
servers launched by Ray actors in a placement group."""

import sys, time
import pytest
import requests
import torch
from memagent.engines import (
    SGLangEngine,
    SamplingParams,
    DeterministicEngineError,
    ServerLaunchError,
    MEMORY_TAGS,
    engine_from_config,
)
from memagent.testing import FakeSGLangServer, SGLANG_SCHEMAS, schema_error
from memagent.checkpoint import push_weights

SP = SamplingParams(4, seed=3)


def _client(srvs, **kw):
    return SGLangEngine(
        [s.url for s in srvs], timeout_s=10, max_retries=1, backoff_s=0.01, colocated=True, **kw
    )


def _calls(srv):
    return [(e['path'], e['body']) for e in srv.log]


def _schema_ok(srv):
    """Every request the server got fits SGLang's request class for its route (no unknown, missing
    or ill-typed field)."""
    for path, body in _calls(srv):
        assert schema_error(path, body) is None, (path, body)


@pytest.fixture(scope='module')
def tiny():
    from memagent.models import load_model, load_tokenizer

    model, tok = load_model('tiny-qwen3'), load_tokenizer('tiny-qwen3')
    g = torch.Generator().manual_seed(0)
    sd = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    return model, tok, sd


def test_disk_sync_order_and_bodies(tmp_path, tiny):
    """release -> resume weights -> update from disk -> resume KV cache -> flush, on every server,
    with SGLang's exact bodies."""
    model, tok, sd = tiny
    with FakeSGLangServer() as a, FakeSGLangServer() as b:
        cl = _client([a, b])
        cl.release_memory()
        cl.release_memory()  # already released: nothing more is sent
        dt = push_weights(cl, sd, model, tok, tmp_path / 'sync')
        assert dt > 0 and (tmp_path / 'sync' / 'config.json').is_file()
        want = [
            ('/release_memory_occupation', {'tags': ['kv_cache', 'weights', 'cuda_graph']}),
            ('/resume_memory_occupation', {'tags': ['weights']}),
            (
                '/update_weights_from_disk',
                {'model_path': str(tmp_path / 'sync'), 'flush_cache': False},
            ),
            ('/resume_memory_occupation', {'tags': ['kv_cache', 'cuda_graph']}),
            ('/flush_cache', {}),
        ]
        assert _calls(a) == want and _calls(b) == want
        _schema_ok(a)
        assert a.released == set() and cl.released == ()
        cl.close()


def test_synced_weights_serve(tmp_path, tiny):
    """After the colocated disk sync the server samples what an engine holding the same weights
    samples."""
    from memagent.models import load_model
    from memagent.engines import HFEngine

    model, tok, sd = tiny
    ref = HFEngine(load_model('tiny-qwen3'), tok)
    ref.sync_weights(sd)
    with FakeSGLangServer(engine=HFEngine(load_model('tiny-qwen3'), tok)) as srv:
        cl = _client([srv])
        cl.release_memory()
        push_weights(cl, sd, model, tok, tmp_path / 'sync')
        prompt = tok.encode('The memory agent reads')
        assert cl.generate([prompt], SP)[0].output_ids == ref.generate([prompt], SP)[0].output_ids
        cl.close()


def test_tensor_sync_order_and_payload():
    """weight_sync='tensor' (checked on CPU for call order and request schema only): begin / tensor
    / end between the resumes."""
    sd = {'model.norm.weight': torch.arange(4.0), 'lm_head.weight': torch.ones(2, 3)}
    with FakeSGLangServer(tp_size=2) as srv:
        cl = _client([srv], tp_size=2, weight_sync='tensor')
        cl.release_memory()
        cl.sync_weights(sd)
        calls = _calls(srv)
        assert [p for p, _ in calls] == [
            '/release_memory_occupation',
            '/resume_memory_occupation',
            '/begin_weight_update',
            '/update_weights_from_tensor',
            '/end_weight_update',
            '/resume_memory_occupation',
            '/flush_cache',
        ]
        assert calls[2][1] == {} and calls[4][1] == {} and calls[1][1] == {'tags': ['weights']}
        body = calls[3][1]
        assert (
            set(body)
            == {'serialized_named_tensors', 'load_format', 'flush_cache'}
            <= set(SGLANG_SCHEMAS['/update_weights_from_tensor'])
        )
        assert (
            len(body['serialized_named_tensors']) == 2
            and body['load_format'] is None
            and body['flush_cache'] is False
        )
        assert srv.tensor_updates == [
            {'names': list(sd), 'ranks': 2, 'load_format': None, 'flush_cache': False}
        ]
        _schema_ok(srv)
        assert not srv.session and srv.released == set()
        cl.close()


def test_tensor_failure_closes_the_session():
    """A refused tensor update still ends the weight-update session, and the error names the server
    and the route."""
    with FakeSGLangServer(tp_size=2) as srv:
        # one payload for a two-rank server: refused
        cl = _client([srv], tp_size=1, weight_sync='tensor')
        with pytest.raises(DeterministicEngineError, match='update_weights_from_tensor.*TP ranks'):
            cl.update_weights(state_dict={'w': torch.ones(2)})
        assert [p for p, _ in _calls(srv)] == [
            '/begin_weight_update',
            '/update_weights_from_tensor',
            '/end_weight_update',
        ]
        assert not srv.session
        cl.close()


def test_no_generate_while_released():
    """The client refuses generate while released and sends nothing; the schema server would reject
    one that came anyway."""
    with FakeSGLangServer() as srv:
        cl = _client([srv])
        assert len(cl.generate([[1, 2, 3]], SP)[0].output_ids) == 4
        cl.release_memory()
        for ret in (False, True):
            with pytest.raises(
                DeterministicEngineError, match='generate refused.*kv_cache, weights, cuda_graph'
            ):
                cl.generate([[1, 2, 3]], SP, return_exceptions=ret)
        r = requests.post(
            srv.url + '/generate',
            json={'input_ids': [1, 2, 3], 'sampling_params': {'max_new_tokens': 2}},
            timeout=5,
        )
        assert r.status_code == 400 and 'released' in r.json()['error']['message']
        released_at = [
            i for i, (p, _) in enumerate(_calls(srv)) if p == '/release_memory_occupation'
        ][0]
        # only the raw request above, refused
        assert [p for p, _ in _calls(srv)[released_at + 1 :]] == ['/generate']
        assert srv.log[-1]['status'] == 400
        cl.resume_memory()
        assert cl.released == () and len(cl.generate([[1, 2, 3]], SP)[0].output_ids) == 4
        cl.close()


def test_sync_without_release_sends_no_resume(tmp_path, tiny):
    """A sync with nothing released (a trainer restoring a checkpoint) resumes nothing: SGLang dies
    on a resume of an unreleased tag."""
    model, tok, sd = tiny
    with FakeSGLangServer() as srv:
        cl = _client([srv])
        push_weights(cl, sd, model, tok, tmp_path / 'w')
        assert [p for p, _ in _calls(srv)] == ['/update_weights_from_disk', '/flush_cache']
        r = requests.post(
            srv.url + '/resume_memory_occupation', json={'tags': ['weights']}, timeout=5
        )
        assert r.status_code == 400 and 'not released' in r.text
        with pytest.raises(ValueError, match='unknown memory tags'):
            cl.resume_memory(('weight',))
        cl.close()


def test_memory_calls_are_not_retried_and_name_the_state():
    with FakeSGLangServer() as srv:
        cl = _client([srv])
        srv.inject('/release_memory_occupation', 503)
        with pytest.raises(
            Exception, match=r'release_memory_occupation .*failed on .*state is now unknown'
        ):
            cl.release_memory()
        assert [e['status'] for e in srv.log] == [503] and cl.released == ()
        cl.close()


def test_non_colocated_engine_is_unchanged(tmp_path):
    with FakeSGLangServer() as srv:
        cl = SGLangEngine([srv.url], timeout_s=10)
        cl.release_memory()
        assert srv.log == [] and cl.released == ()
        assert len(cl.generate([[1, 2]], SP)[0].output_ids) == 4
        cl.close()


def test_engine_from_config_refuses_colocate_without_placement():
    """Colocated engines need the training placement: the trainer's builder asks for it, the plain
    builder names the one to use."""
    from memagent.config import get_preset
    from memagent.colocate import trainer_engine

    cfg = get_preset('tiny', {'rollout.engine': 'sglang', 'rollout.colocate': True})
    with pytest.raises(ValueError, match='needs placement='):
        trainer_engine(cfg)
    with pytest.raises(ValueError, match='memagent.colocate.trainer_engine'):
        engine_from_config(cfg)


# Ray: CPU bundles (the layout's logic) and, on a cluster that declares two GPUs, the
# CUDA_VISIBLE_DEVICES mapping


@pytest.fixture(scope='module')
def ray_cluster():
    import ray
    from memagent.transfer import ensure_ray

    if ray.is_initialized():
        ray.shutdown()
    # started the project's way, with declared GPUs
    yield ensure_ray(num_cpus=4, num_gpus=2, object_store_memory=1 << 28)
    ray.shutdown()


def _fake_cmd(tp):
    from memagent.colocate import HOST, PORT

    return [
        sys.executable,
        '-m',
        'memagent.testing',
        '--host',
        HOST,
        '--port',
        PORT,
        '--tp-size',
        str(tp),
    ]


@pytest.mark.timeout(180)
def test_placement_launch_reach_and_shutdown(ray_cluster):
    from memagent.colocate import Placement, launch_servers, TRAIN_SHARE

    pl = Placement(2, 2, use_gpu=False)
    try:
        assert (pl.bundle, pl.n_engines, sorted(pl.order), pl.engine_env(0)) == (
            {'CPU': 1},
            1,
            [0, 1],
            {},
        )
        assert [
            pl.train_options(r)['scheduling_strategy'].placement_group_bundle_index for r in (0, 1)
        ] == pl.order
        assert (
            pl.train_options(0)['num_cpus'] == TRAIN_SHARE and pl.train_options(0)['num_gpus'] == 0
        )
        servers = launch_servers(pl, [_fake_cmd(2)], startup_timeout_s=120, grace_s=10)
        info = servers.info()[0]
        assert info['placement_group'] == pl.pg.id.hex() and info['url'] == servers.urls[0]
        assert info['cmd'][info['cmd'].index('--port') + 1] == info['url'].rsplit(':', 1)[1]
        cl = SGLangEngine(
            servers.urls,
            timeout_s=30,
            colocated=True,
            tp_size=2,
            weight_sync='tensor',
            on_close=servers.stop,
        )
        assert len(cl.generate([[5, 6, 7]], SP)[0].output_ids) == 4
        cl.release_memory()
        with pytest.raises(DeterministicEngineError, match='generate refused'):
            cl.generate([[5, 6, 7]], SP)
        # the payload crosses processes: the server decodes both ranks
        cl.sync_weights({'w': torch.arange(3.0)})
        assert len(cl.generate([[5, 6, 7]], SP)[0].output_ids) == 4
        cl.close()
        with pytest.raises(requests.ConnectionError):
            requests.get(info['url'] + '/health', timeout=2)
        assert servers.actors == []
    finally:
        pl.remove()


@pytest.mark.timeout(120)
def test_gpu_bundles_map_engines_to_their_gpus(ray_cluster):
    from memagent.colocate import Placement, TRAIN_SHARE, SERVER_SHARE

    pl = Placement(2, 2, use_gpu=True)  # the cluster declares two GPUs: Ray hands out ids 0 and 1
    try:
        assert pl.bundle == {'GPU': 1, 'CPU': 1} and sorted(
            g for ids in pl.gpu_ids for g in ids
        ) == ['0', '1']
        assert pl.engine_env(0) == {'CUDA_VISIBLE_DEVICES': ','.join(pl.gpu_ids[0] + pl.gpu_ids[1])}
        # ranks follow the GPU order
        assert pl.gpu_ids == sorted(pl.gpu_ids, key=lambda ids: int(ids[0]))
        assert (
            pl.train_options(1)['num_gpus'] == TRAIN_SHARE
            and pl.engine_options(0)['num_gpus'] == SERVER_SHARE
        )
        assert TRAIN_SHARE + SERVER_SHARE <= 1
    finally:
        pl.remove()


@pytest.mark.timeout(120)
def test_failed_server_launch_is_reported_and_cleaned_up(ray_cluster, tmp_path):
    from memagent.colocate import Placement, launch_servers

    pl = Placement(1, 1, use_gpu=False)
    try:
        with pytest.raises(ServerLaunchError, match='no CUDA here'):
            launch_servers(
                pl,
                [[sys.executable, '-c', 'print("no CUDA here"); raise SystemExit(3)']],
                log_dir=tmp_path,
                startup_timeout_s=60,
            )
    finally:
        pl.remove()
