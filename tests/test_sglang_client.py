"The SGLang client against a local server speaking SGLang's native schema, with injected failures."

import sys, time
import pytest
from memagent.engines import (
    SGLangEngine,
    SGLangServer,
    ServerProcess,
    SamplingParams,
    GenerationResult,
    EngineError,
    TransientEngineError,
    DeterministicEngineError,
    ServerLaunchError,
    free_port,
    HFEngine,
)
from memagent.testing import FakeSGLangServer, fake_tokens

SP = SamplingParams(6, seed=11, stop_token_ids=())


@pytest.fixture
def srv():
    with FakeSGLangServer(slow_s=1.5) as s:
        yield s


def client(urls, **kw):
    kw = {'timeout_s': 5, 'max_retries': 2, 'backoff_s': 0.01, 'concurrency': 4, **kw}
    return SGLangEngine(urls, **kw)


def test_schema_and_results(srv):
    cl = client([srv.url])
    r = cl.generate([[1, 2, 3], [4, 5]], [SP, SamplingParams(3, seed=2)])
    assert [x.output_ids for x in r] == [
        fake_tokens([1, 2, 3], SP)[0],
        fake_tokens([4, 5], SamplingParams(3, seed=2))[0],
    ]
    assert all(isinstance(x, GenerationResult) and len(x.logprobs) == len(x.output_ids) for x in r)
    body = srv.calls[0]
    assert body['return_logprob'] is True and body['logprob_start_len'] == -1
    assert set(body['sampling_params']) >= {
        'max_new_tokens',
        'temperature',
        'top_p',
        'top_k',
        'stop_token_ids',
        'sampling_seed',
    }
    assert cl.stats['requests'] == 2 and cl.stats['retries'] == 0
    cl.close()


def test_5xx_then_success_is_retried_and_counted(srv):
    cl = client([srv.url])
    srv.faults = [500, 503]
    r = cl.generate([[1, 2, 3]], SP)[0]
    assert r.output_ids == fake_tokens([1, 2, 3], SP)[0]
    assert cl.stats['retries'] == 2 and cl.stats['transient_failures'] == 2 and len(srv.calls) == 3
    cl.close()


def test_4xx_fails_fast(srv):
    cl = client([srv.url])
    srv.faults = [400]
    with pytest.raises(DeterministicEngineError, match='400'):
        cl.generate([[1, 2, 3]], SP)
    assert (
        cl.stats['retries'] == 0 and cl.stats['deterministic_failures'] == 1 and len(srv.calls) == 1
    )
    cl.close()


def test_abort_is_transient(srv):
    cl = client([srv.url], max_retries=1)
    srv.faults = ['abort']
    assert cl.generate([[7, 8]], SP)[0].finish_reason in ('stop', 'length')
    assert cl.stats['retries'] == 1
    srv.faults = ['abort', 'abort']
    with pytest.raises(TransientEngineError, match='2 attempts'):
        cl.generate([[7, 8]], SP)
    cl.close()


def test_timeout_retried_then_fails_in_bounded_time(srv):
    cl = client([srv.url], timeout_s=0.3, max_retries=2, backoff_s=0.05)
    srv.faults = ['slow', 'slow', 'slow']
    t0 = time.monotonic()
    with pytest.raises(TransientEngineError, match='timed out'):
        cl.generate([[1]], SP)
    dt = time.monotonic() - t0
    assert dt < 5, dt  # three 0.3 s attempts; waiting out the 2 s replies would take 6 s
    assert cl.stats['retries'] == 2 and cl.stats['transient_failures'] == 3
    cl.close()


def test_connection_refused_is_transient_and_bounded():
    cl = client([f"http://127.0.0.1:{free_port()}"], max_retries=2)
    t0 = time.monotonic()
    r = cl.generate([[1, 2]], SP, return_exceptions=True)[0]
    assert isinstance(r, TransientEngineError) and 'connection' in str(r)
    # three attempts timing out would take 15 s
    assert time.monotonic() - t0 < 12 and cl.stats['retries'] == 2
    cl.close()


def test_failover_to_a_healthy_server(srv):
    dead = f"http://127.0.0.1:{free_port()}"
    cl = client([dead, srv.url], max_retries=1)
    r = cl.generate([[1, 2, 3]] * 6, SP)
    assert all(x.output_ids == fake_tokens([1, 2, 3], SP)[0] for x in r)
    cl.close()


def test_invalid_output_is_deterministic(srv):
    cl = client([srv.url])
    srv.faults = ['invalid']
    r = cl.generate([[1, 2, 3], [1, 2, 3]], SP, return_exceptions=True)
    bad = [x for x in r if isinstance(x, EngineError)]
    assert (
        len(bad) == 1
        and isinstance(bad[0], DeterministicEngineError)
        and 'do not match' in str(bad[0])
    )
    assert cl.stats['retries'] == 0
    cl.close()


# transport faults: each attempt is one HTTP request under a deadline, retried by one policy


@pytest.mark.timeout(20)
def test_cut_body_is_retried(srv):
    cl = client([srv.url], max_retries=2)
    srv.faults = ['cut', 'cut']  # headers, then half the body, then the connection closes
    r = cl.generate([[1, 2, 3]], SP)[0]
    assert r.output_ids == fake_tokens([1, 2, 3], SP)[0]
    assert cl.stats['retries'] == 2 and cl.stats['transient_failures'] == 2 and len(srv.calls) == 3
    srv.faults = ['cut', 'cut', 'cut']
    with pytest.raises(TransientEngineError, match='3 attempts.*ChunkedEncodingError'):
        cl.generate([[1, 2, 3]], SP)
    cl.close()


@pytest.mark.timeout(20)
def test_cut_body_keeps_the_other_results(srv):
    # one worker: requests reach the server in prompt order
    cl = client([srv.url], max_retries=0, concurrency=1)
    srv.faults = ['cut']
    prompts = [[1, 2, 3], [4, 5], [6]]
    r = cl.generate(prompts, SP, return_exceptions=True)
    assert isinstance(r[0], TransientEngineError) and 'ChunkedEncodingError' in str(r[0])
    assert [x.output_ids for x in r[1:]] == [fake_tokens(p, SP)[0] for p in prompts[1:]]
    srv.faults = ['cut']
    # without return_exceptions the error is raised, as an EngineError
    with pytest.raises(TransientEngineError):
        cl.generate(prompts, SP)
    cl.close()


@pytest.mark.timeout(20)
def test_dropped_connection_is_retried(srv):
    cl = client([srv.url])
    srv.faults = ['drop']
    assert cl.generate([[1, 2]], SP)[0].output_ids == fake_tokens([1, 2], SP)[0]
    assert cl.stats['retries'] == 1 and len(srv.calls) == 2
    cl.close()


@pytest.mark.timeout(20)
def test_non_http_reply_is_retried(srv):
    cl = client([srv.url])
    srv.faults = ['garbage']
    assert cl.generate([[1, 2]], SP)[0].output_ids == fake_tokens([1, 2], SP)[0]
    assert cl.stats['retries'] == 1
    cl.close()


@pytest.mark.timeout(15)
@pytest.mark.parametrize('kind', ['trickle', 'trickle_all'])
def test_trickled_reply_hits_the_deadline(kind):
    # a byte every 0.05 s: no read waits longer than the 0.5 s timeout, yet the whole reply would
    # take ~20-30 s
    with FakeSGLangServer(trickle_s=0.05) as s:
        cl = client([s.url], timeout_s=0.5, max_retries=1, backoff_s=0.01)
        s.faults = [kind, kind]
        t0 = time.monotonic()
        r = cl.generate([[1, 2, 3]], SP, return_exceptions=True)[0]
        dt = time.monotonic() - t0
        assert (
            isinstance(r, TransientEngineError)
            and '0.5s deadline' in str(r)
            and '2 attempts' in str(r)
        )
        assert dt < 8, dt  # two attempts of 0.5 s, not the 20-30 s of the whole reply
        s.faults = [kind]
        # the retry is served whole
        assert cl.generate([[1, 2, 3]], SP)[0].output_ids == fake_tokens([1, 2, 3], SP)[0]
        cl.close()


@pytest.mark.timeout(20)
def test_update_weights_500_then_200_is_retried(srv, tmp_path):
    cl = client([srv.url], max_retries=1)
    srv.inject('/update_weights_from_disk', 500)
    cl.update_weights(path=tmp_path)
    assert [e['status'] for e in srv.log if e['path'] == '/update_weights_from_disk'] == [500, 200]
    assert srv.weight_paths == [str(tmp_path)] and cl.stats['retries'] == 1
    assert [e['path'] for e in srv.log][-1] == '/flush_cache'
    srv.inject('/update_weights_from_disk', 503, 503)
    with pytest.raises(TransientEngineError, match='2 attempts.*HTTP 503'):
        cl.update_weights(path=tmp_path)
    cl.close()


@pytest.mark.timeout(20)
def test_update_weights_cut_reply_is_retried(srv, tmp_path):
    cl = client([srv.url], max_retries=2)
    srv.inject('/update_weights_from_disk', 'cut')
    srv.inject('/flush_cache', 'drop')
    cl.update_weights(path=tmp_path)
    # the cut reply's load happened; loading again is safe
    assert srv.weight_paths == [str(tmp_path)] * 2
    assert [e['path'] for e in srv.log].count('/flush_cache') == 2 and cl.stats['retries'] == 2
    cl.close()


@pytest.mark.timeout(20)
def test_later_endpoints_share_the_transport(tmp_path):
    """An endpoint the client does not know yet (here a memory-occupation one) gets the same
    deadline, retries and kinds."""
    with FakeSGLangServer(trickle_s=0.05) as a, FakeSGLangServer() as b:
        for s in (a, b):
            s.routes[('POST', '/release_memory_occupation')] = lambda ex: setattr(
                ex, 'reply', {'success': True}
            )
        cl = client([a.url, b.url], timeout_s=0.5, max_retries=2)
        a.inject('/release_memory_occupation', 500, 'cut')
        b.inject('/release_memory_occupation', 'trickle')
        assert cl.post_each('/release_memory_occupation', {}) == [
            {'success': True},
            {'success': True},
        ]
        # no failover: each server answers itself
        assert [e['status'] for e in a.log] == [500, 200, 200] and len(b.log) == 2
        assert cl.stats['retries'] == 3
        a.inject('/release_memory_occupation', 404)
        with pytest.raises(DeterministicEngineError, match='404'):
            cl.post('/release_memory_occupation', {}, url=a.url)
        with pytest.raises(ValueError, match='not one of'):
            cl.post('/release_memory_occupation', {}, url='http://127.0.0.1:1')
        cl.close()


def test_stop_token_is_kept_and_aligned():
    """SGLang's rule: a stop token, or an EOS id the request did not list, is the last output id,
    with its log-prob; no_stop_trim is sent."""
    with FakeSGLangServer(eos_token_ids=[999]) as srv:
        cl = client([srv.url])
        free = fake_tokens([1, 2, 3], SamplingParams(8, seed=4))[0]
        stop = free[2]
        r = cl.generate([[1, 2, 3]], SamplingParams(8, seed=4, stop_token_ids=(stop,)))[0]
        k = free.index(stop) + 1
        assert (
            r.output_ids == free[:k]
            and r.output_ids[-1] == stop
            and len(r.logprobs) == k
            and r.finish_reason == 'stop'
        )
        assert srv.calls[-1]['sampling_params']['no_stop_trim'] is True
        with FakeSGLangServer(eos_token_ids=[stop]) as eos:  # the model's EOS stops too, unlisted
            ce = client([eos.url])
            r = ce.generate([[1, 2, 3]], SamplingParams(8, seed=4))[0]
            assert r.output_ids == free[:k] and r.finish_reason == 'stop'
            ce.close()
        cl.close()


def test_misaligned_stop_is_refused():
    """A reply whose stop token is missing from output_ids and output_token_logprobs, or that
    stopped on a string, fails fast."""

    def drop_stop(srv, ex, handle):
        handle(ex)
        ex.reply['output_ids'].pop()
        ex.reply['meta_info']['output_token_logprobs'].pop()

    def nan_stop(srv, ex, handle):
        handle(ex)
        ex.reply['meta_info']['finish_reason'] = {'type': 'stop', 'matched': 'NaN happened'}

    with FakeSGLangServer() as srv:
        srv.fault_kinds.update(drop_stop=drop_stop, nan_stop=nan_stop)
        free = fake_tokens([1, 2, 3], SamplingParams(8, seed=4))[0]
        sp = SamplingParams(8, seed=4, stop_token_ids=(free[2],))
        cl = client([srv.url])
        srv.faults = ['drop_stop']
        with pytest.raises(DeterministicEngineError, match='keeps the matched stop token'):
            cl.generate([[1, 2, 3]], sp)
        srv.faults = ['nan_stop']
        with pytest.raises(DeterministicEngineError, match='NaN happened'):
            cl.generate([[1, 2, 3]], sp)
        assert cl.stats['retries'] == 0 and cl.stats['deterministic_failures'] == 2
        cl.close()


def test_load_balancing_spreads_requests():
    with FakeSGLangServer() as a, FakeSGLangServer() as b:
        cl = client([a.url, b.url], concurrency=4)
        cl.generate([[i + 1] for i in range(20)], SP)
        assert len(a.calls) >= 5 and len(b.calls) >= 5 and len(a.calls) + len(b.calls) == 20
        cl.close()


def test_update_weights_and_health(srv, tmp_path):
    cl = client([srv.url])
    assert cl.health()
    cl.update_weights(path=tmp_path)
    assert srv.weight_paths == [str(tmp_path)]
    with pytest.raises(EngineError, match='failed'):
        cl.update_weights(path=tmp_path / 'missing')
    with pytest.raises(DeterministicEngineError):
        cl.update_weights(state_dict={})
    srv.healthy = False
    assert not cl.health()
    cl.close()
    assert not client([f"http://127.0.0.1:{free_port()}"]).health()


def test_backed_by_tiny_model_matches_in_process():
    from memagent.models import load_model, load_tokenizer

    eng = HFEngine(load_model('tiny-qwen3'), load_tokenizer('tiny-qwen3'))
    with FakeSGLangServer(engine=eng) as s:
        cl = client([s.url])
        r = cl.generate([[100, 200, 300]], SamplingParams(4, seed=5))[0]
        assert (
            r.output_ids == eng.generate([[100, 200, 300]], SamplingParams(4, seed=5))[0].output_ids
        )
        cl.close()


def test_prompt_logprobs_each_asks_every_server_in_order():
    # the weight check's request (logprob_start_len=0) answered by each server for itself, parsed
    # strictly
    import torch
    from memagent.models import load_model, load_tokenizer

    tok = load_tokenizer('tiny-qwen3')
    ea, eb = HFEngine(load_model('tiny-qwen3'), tok), HFEngine(load_model('tiny-qwen3'), tok)
    with torch.no_grad():
        for p in eb.model.parameters():
            p.mul_(1.01)  # the second server holds other weights
    prompt = [100, 200, 300, 400]
    with FakeSGLangServer(engine=ea) as a, FakeSGLangServer(engine=eb) as b:
        cl = client([a.url, b.url])
        got = cl.prompt_logprobs_each(prompt)
        assert (
            got == [ea.prompt_logprobs(prompt), eb.prompt_logprobs(prompt)]
            and got[0] != got[1]
            and len(got[0]) == 3
        )
        assert len(a.calls) == len(b.calls) == 1
        body = a.calls[0]
        assert (
            body['return_logprob'],
            body['logprob_start_len'],
            body['top_logprobs_num'],
            body['return_text_in_logprobs'],
            body['sampling_params']['max_new_tokens'],
            body['sampling_params']['temperature'],
        ) == (True, 0, 0, False, 1, 0.0)
        b.faults = ['invalid_prompt_logprobs']  # b's entries no longer line up with the prompt
        with pytest.raises(DeterministicEngineError, match='3 entries for a prompt of 4 tokens'):
            cl.prompt_logprobs_each(prompt)
        assert len(b.calls) == 2 and cl.stats['retries'] == 0  # deterministic: not retried
        cl.close()


def test_server_launch_failure_is_reported_not_hung(tmp_path):
    s = ServerProcess(
        [sys.executable, '-c', 'import sys; print("boom: no CUDA"); sys.exit(2)'],
        f"http://127.0.0.1:{free_port()}",
        tmp_path / 'log',
        startup_timeout_s=60,
    )
    t0 = time.monotonic()
    with pytest.raises(ServerLaunchError, match='boom: no CUDA'):
        s.start()
    assert time.monotonic() - t0 < 45  # not the 60 s startup timeout: the exit is noticed


def test_server_startup_timeout_stops_the_process(tmp_path):
    s = ServerProcess(
        [sys.executable, '-c', 'import time; time.sleep(60)'],
        f"http://127.0.0.1:{free_port()}",
        tmp_path / 'log',
        startup_timeout_s=1.5,
        grace_s=2,
    )
    with pytest.raises(ServerLaunchError, match='not healthy'):
        s.start()
    assert s.proc.poll() is not None


def test_sglang_server_command(tmp_path):
    s = SGLangServer(
        '/models/m',
        tp=2,
        context_length=4096,
        extra_args=('--enable-deterministic-inference',),
        log_path=tmp_path / 'log',
        python='/opt/py/bin/python',
    )
    assert (
        s.cmd[:3] == ['/opt/py/bin/python', '-m', 'sglang.launch_server']
        and s.url == f'http://127.0.0.1:{s.port}'
    )
    flags = dict(zip(s.cmd[3:-1:2], s.cmd[4::2]))
    assert flags == {
        '--model-path': '/models/m',
        '--host': '127.0.0.1',
        '--port': str(s.port),
        '--context-length': '4096',
        '--tp-size': '2',
        '--mem-fraction-static': '0.8',
    }
    assert s.cmd[-1] == '--enable-deterministic-inference' and s.proc is None


@pytest.mark.gpu
def test_real_sglang_server(tmp_path):
    from memagent.models import model_dir, load_model

    d = model_dir('tiny-qwen3')
    with SGLangServer(
        d,
        context_length=2048,
        mem_fraction=0.3,
        log_path=tmp_path / 'sglang.log',
        startup_timeout_s=600,
        extra_args=('--enable-deterministic-inference',),
    ) as srv:
        cl = SGLangEngine([srv.url], timeout_s=120, max_retries=1)
        assert cl.health()
        prompt = [100, 200, 300, 400]
        a = cl.generate([prompt], SamplingParams(8, seed=3))[0]
        b = cl.generate([prompt], SamplingParams(8, seed=3))[0]
        assert a.output_ids == b.output_ids and len(a.logprobs) == len(a.output_ids)
        ref = HFEngine(load_model('tiny-qwen3', device='cuda')).logprobs(prompt, a.output_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, ref)) < 1e-2
        cl.update_weights(path=d)
        cl.close()


def test_model_info_reports_what_each_server_serves():
    with (
        FakeSGLangServer(model_path='/models/a', weight_version='w1') as a,
        FakeSGLangServer(model_path='/models/b') as b,
    ):
        cl = SGLangEngine([a.url, b.url], max_retries=0)
        info = cl.model_info()
        assert [
            (i['url'], i['model_path'], i['weight_version'], i['is_generation']) for i in info
        ] == [(a.url, '/models/a', 'w1', True), (b.url, '/models/b', 'default', True)]
        assert cl.identity() == {'kind': 'sglang', 'servers': info}
        b.routes[('GET', '/get_model_info')] = lambda ex: setattr(
            ex, 'reply', {'weight_version': 'x'}
        )
        with pytest.raises(
            DeterministicEngineError, match=f'{b.url}/get_model_info: no model_path'
        ):
            cl.model_info()
        cl.close()
