"""Fast checks of the recipe core: templates, chunking, memory bound and rewards."""

import random, re, shutil, time, tracemalloc
from pathlib import Path

import pytest

from memagent import chunking, prompts, reward
from memagent.models import load_tokenizer
from memagent.provenance import sha256_file

ROOT = Path(__file__).resolve().parents[1]
# an optional outside copy of the MemAgent templates
REF_DIRS = [ROOT.parent / 'shared' / 'reference' / 'prompts']


@pytest.fixture(scope='module')
def qwen():
    return load_tokenizer('qwen3')


def test_templates_match_pinned_sha256():
    "Always runs: every shipped template file hashes to the SHA-256 pinned in the package."
    files = sorted(prompts.PROMPTS_DIR.glob('*.txt'))
    assert sorted(p.stem for p in files) == sorted(prompts.TEMPLATE_SHA256)
    for p in files:
        assert sha256_file(p) == prompts.TEMPLATE_SHA256[p.stem], p.name
    assert prompts.template_sha256s() == prompts.TEMPLATE_SHA256


def test_changed_template_byte_is_refused(tmp_path):
    for p in prompts.PROMPTS_DIR.glob('*.txt'):
        shutil.copy(p, tmp_path)
    assert prompts.check_templates(tmp_path) == prompts.TEMPLATE_SHA256
    f = tmp_path / 'memory_eval.txt'
    b = bytearray(f.read_bytes())
    b[0] ^= 1
    f.write_bytes(bytes(b))
    with pytest.raises(ValueError, match='memory_eval.txt has SHA-256'):
        prompts.check_templates(tmp_path)


@pytest.mark.parametrize('ref', [d for d in REF_DIRS if d.is_dir()] or [None])
def test_templates_byte_exact_to_outside_reference(ref):
    "Optional extra: when a reference copy sits beside the repository, the bytes equal it too."
    if ref is None:
        pytest.skip(
            f'no outside reference copy at {REF_DIRS[0]} (the pinned SHA-256 test covers this '
            'clone)'
        )
    ref_files = sorted(p.name for p in ref.glob('*.txt'))
    assert sorted(p.name for p in prompts.PROMPTS_DIR.glob('*.txt')) == ref_files
    for name in ref_files:
        assert (prompts.PROMPTS_DIR / name).read_bytes() == (ref / name).read_bytes(), name


def test_template_shas_and_record():
    shas = prompts.template_sha256s()
    assert set(shas) == set(prompts.TEMPLATES) and all(len(v) == 64 for v in shas.values())
    rec = prompts.prompt_record('train', 'off')
    assert (
        rec['templates']['memory'] == 'memory_train'
        and rec['template_sha256']['final'] == shas['final_train']
    )


def test_final_prompt_has_no_chunk_text(qwen):
    doc = ' '.join(f'needle{i} sits in haystack sentence {i}.' for i in range(200))
    ch = chunking.chunk_document(doc, qwen, 64, 8)
    memory = prompts.NO_MEMORY
    for text in ch.texts:
        p = prompts.memory_prompt('Where is needle3?', memory, text, 'train')
        assert text in p
        memory, n = prompts.memory_from_response(f'Saw {len(text)} chars.', qwen, 32, 'strip')
    final = prompts.final_prompt('Where is needle3?', memory, 'train')
    for text in ch.texts:
        assert text.strip() not in final
    assert '<section>' not in final and '{chunk}' not in final


def test_million_token_document(qwen):
    rng = random.Random(1)
    words = [' memory', ' agent', ' reads', ' long', ' document', ' chunk']
    big = 'memory' + ''.join(rng.choice(words) for _ in range(10**6 - 1))
    t0 = time.time()
    tracemalloc.start()
    try:
        c = chunking.chunk_document(big, qwen, 2048, 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert c.total_tokens == 10**6 and c.num_chunks == 64 and c.total_chunks == 489
    assert c.truncated and c.dropped_chunks == 425 and c.dropped_tokens == 10**6 - 64 * 2048
    # a list of a million Python ints alone would be ~36 MB of traced allocations
    assert peak < 30e6, f'peak traced allocation {peak / 1e6:.1f} MB'
    # linear, not quadratic: a quadratic cut of 10**6 tokens takes hours
    assert time.time() - t0 < 300


def test_chunk_properties():
    rng = random.Random(0)
    for _ in range(200):
        n, size = rng.randint(0, 300), rng.randint(1, 40)
        mx = rng.choice([None, 0, 1, 3, 64])
        ids = [rng.randrange(1000) for _ in range(n)]
        c = chunking.chunk_ids(ids, size, mx)
        kept = [i for ch in c.token_ids for i in ch]
        assert kept == ids[: len(kept)]  # contiguous prefix, no overlap
        assert all(k == size for k in c.token_counts[:-1])
        assert c.total_chunks == -(-n // size)
        assert c.num_chunks == (c.total_chunks if mx is None else min(mx, c.total_chunks))
        assert sum(c.token_counts) + c.dropped_tokens == n
        t = chunking.trim_centre(ids, size)
        assert len(t) == min(n, size) and t[: size // 2] == ids[: size // 2][: len(t)]


def test_sliced_encoding_exact(qwen):
    text = 'Q: Who?\n\nDocument 3:\nCafé — 東京, 1999; naïve 😀 end.  x\t y\n' * 30
    ids, hard = chunking.encode_long(text, qwen, piece_chars=300)
    assert hard == 0 and list(ids) == qwen.encode(text, add_special_tokens=False)


def test_bound_memory_property(qwen):
    rng = random.Random(2)
    alphabet = list('ab .,\n') + ['é', '東', '😀', '𓀀', 'ing', ' the']
    for _ in range(60):
        s = ''.join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        m = rng.randint(0, 20)
        t, ids = prompts.bound_memory(s, qwen, m)
        assert len(ids) <= m and qwen.encode(t, add_special_tokens=False) == ids


def test_substitution_one_pass():
    q = 'a {memory} b {chunk} c {question}'
    p = prompts.memory_prompt(q, 'MEM {question}', 'CH {memory}', 'eval')
    assert q in p and 'MEM {question}' in p and 'CH {memory}' in p


def test_reward_properties():
    assert reward.get_reward('boxed_em')(r'\boxed{The Beatles!}', ['x', 'beatles']) == 1.0
    assert reward.extract_boxed(r'\boxed{a}' + ' ' * 300) == ''
    assert (
        reward.sub_em('no', 'Nottingham') == 1.0 and reward.strict_sub_em('no', 'Nottingham') == 0.0
    )
    assert reward.f1_score('yes', 'no') == 0.0
    for name, fn in reward.REWARDS.items():
        for resp in ['', r'\boxed{x}', 'x', r'\boxed{']:
            v = fn(resp, ['x'])
            assert 0.0 <= v <= 1.0, (name, resp, v)
    with pytest.raises(KeyError, match='known rewards'):
        reward.get_reward('missing')


def test_unknown_model_name_is_named_with_the_names_known_offline(monkeypatch, tmp_path):
    from memagent import models

    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    for load in (models.load_model, models.load_tokenizer):
        with pytest.raises(FileNotFoundError) as e:
            load('tiny-qwen')
        msg = str(e.value)
        assert (
            "model 'tiny-qwen'" in msg
            and "known offline: built-in ['qwen3', 'smollm2-135m-instruct', 'tiny-qwen3']" in msg
        )
    with pytest.raises(FileNotFoundError, match=r"model '/no/such/model': no such directory"):
        models.load_model('/no/such/model')
    hub = tmp_path / 'hub'
    (hub / 'models--Org--Name' / 'snapshots' / 'abc').mkdir(parents=True)
    (hub / 'models--Org--Empty').mkdir()
    assert models.known_models(hub) == {
        'built-in': ['qwen3', 'smollm2-135m-instruct', 'tiny-qwen3'],
        'hub cache': ['Org/Name'],
    }
    with pytest.raises(ValueError, match='non-empty'):
        models.load_model('')


def test_corrupt_model_weights_name_the_file(tmp_path):
    from memagent import models

    d = Path(shutil.copytree(models.model_dir('tiny-qwen3'), tmp_path / 'm'))
    w = d / 'model.safetensors'
    full = w.read_bytes()
    w.write_bytes(full[: len(full) // 2])
    with pytest.raises(
        ValueError,
        match=(
            rf"{re.escape(str(w))}: not a complete safetensors file \(\d+ bytes, its header "
            r"describes \d+\)"
        ),
    ):
        models.load_model(d)
    w.write_bytes(full[:3])
    with pytest.raises(ValueError, match=rf"{re.escape(str(w))}: not a complete safetensors file"):
        models.load_model(str(d))
    w.write_bytes(full)
    assert models.load_model(d) is not None
