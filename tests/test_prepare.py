"""`memagent-prepare` against a local server answering the hub's resolve requests, offline copies,
and `prepared_file`."""

import hashlib, json, os, shutil, subprocess, sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_hub import FakeHub, git_blob_sha1, pinned_format_files  # noqa: E402

from memagent.data import PINNED, PrepareError, prepare, prepared_file, read_examples  # noqa: E402
from memagent.provenance import sha256_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NAMES = list(PINNED['files'])
GIT_FILE = (
    'eval_50.json'  # served as a plain git file (ETag: git blob SHA-1); the others as LFS files
)
FILES = pinned_format_files(PINNED['files'])


def hub(**kw):
    return FakeHub(PINNED['repo_id'], PINNED['revision'], FILES, lfs=set(FILES) - {GIT_FILE}, **kw)


def run_prepare(endpoint, tmp, *args):
    """`memagent-prepare` in a fresh interpreter that talks to `endpoint`: huggingface_hub reads
    HF_ENDPOINT and HF_HUB_OFFLINE at import."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE', 'MEMAGENT_DATA_ROOT')
    }
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp / 'hf-home'), PYTHONPATH=str(REPO))
    return subprocess.run(
        [
            sys.executable,
            '-c',
            'import sys; from memagent.data import prepare_cli; sys.exit(prepare_cli())',
            *args,
            '--quiet',
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def resolve_url(endpoint, name):
    return f"{endpoint}/datasets/{PINNED['repo_id']}/resolve/{PINNED['revision']}/{name}"


@pytest.fixture(scope='module')
def online(tmp_path_factory):
    "One good download of every pinned file: (root, hub, first run's result)."
    tmp = tmp_path_factory.mktemp('online')
    with hub() as h:
        r = run_prepare(h.endpoint, tmp, '--root', str(tmp / 'root'))
        first = list(h.requests)
        again = run_prepare(h.endpoint, tmp, '--root', str(tmp / 'root'))
        yield tmp / 'root', h, r, first, again, h.requests[len(first) :]


def test_download_verifies_converts_and_records(online):
    root, h, r, requests, _, _ = online
    assert r.returncode == 0, r.stderr
    m = json.loads((root / 'manifest.json').read_text())
    assert (m['kind'], m['repo_id'], m['repo_type'], m['revision']) == (
        'memagent.data.prepare',
        PINNED['repo_id'],
        'dataset',
        PINNED['revision'],
    )
    assert list(m['files']) == NAMES and m['unverified'] == []
    for name in NAMES:
        f, data = m['files'][name], FILES[name]
        assert f['sha256'] == hashlib.sha256(data).hexdigest() == sha256_file(root / name)
        assert (
            f['bytes'] == len(data)
            and f['revision'] == PINNED['revision']
            and f['verified'] is True
        )
        assert f['url'] == f['source'] == resolve_url(h.endpoint, name)
        if name == GIT_FILE:
            assert (f['verification'], f['hub_hash']) == ('hub-git-blob-sha1', git_blob_sha1(data))
        else:
            assert (f['verification'], f['hub_hash']) == ('hub-lfs-sha256', f['sha256'])
        c = f['converted']
        out = prepared_file(name, root)
        assert (
            out == root / c['path']
            and c['sha256'] == sha256_file(out)
            and c['bytes'] == out.stat().st_size
        )
        rows = read_examples(out)
        assert (
            len(rows) == c['rows'] == c['rows_read'] == (3 if name.endswith('.parquet') else 2)
            and c['rows_skipped'] == 0
        )
    assert [e['answers'] for e in read_examples(prepared_file('eval_200.json', root))] == [
        ['answer 0', 'alias 0'],
        ['answer 1', 'alias 1'],
    ]
    # every file was asked about at the pinned revision, and fetched: LFS files through the CDN
    # redirect
    heads = {
        p.rsplit('/', 1)[1]
        for meth, p in requests
        if meth == 'HEAD' and f"/resolve/{PINNED['revision']}/" in p
    }
    assert heads == set(NAMES)
    gets = [p for meth, p in requests if meth == 'GET' and p != '/api/agent-harnesses']
    assert sorted(gets) == sorted(
        [f"/cdn/{hashlib.sha256(FILES[n]).hexdigest()}" for n in NAMES if n != GIT_FILE]
        + [f"/datasets/{PINNED['repo_id']}/resolve/{PINNED['revision']}/{GIT_FILE}"]
    )
    assert (
        'UNVERIFIED' not in r.stdout
        and r.stdout.count(' hub-lfs-sha256 ') == 4
        and r.stdout.count(' hub-git-blob-sha1 ') == 1
    )


def test_a_second_run_checks_but_does_not_download(online):
    root, _, _, _, again, requests = online
    assert again.returncode == 0, again.stderr
    assert [m for m, p in requests if m == 'GET' and p != '/api/agent-harnesses'] == []
    assert {p.rsplit('/', 1)[1] for m, p in requests if m == 'HEAD'} == set(NAMES)


def test_unknown_revision_refused(tmp_path):
    # the server's repository has another commit
    with FakeHub(PINNED['repo_id'], 'f' * 40, FILES) as h:
        r = run_prepare(
            h.endpoint, tmp_path, '--root', str(tmp_path / 'root'), '--files', 'eval_200.json'
        )
    assert r.returncode == 2
    assert (
        f"revision {PINNED['revision']} of dataset {PINNED['repo_id']} not found at {h.endpoint}: "
        "refused" in r.stderr
    )
    assert (
        not (tmp_path / 'root' / 'eval_200.json').exists()
        and not (tmp_path / 'root' / 'manifest.json').exists()
    )


def test_resolved_to_another_commit_refused(tmp_path):
    with hub(resolved_commit='e' * 40) as h:
        r = run_prepare(
            h.endpoint, tmp_path, '--root', str(tmp_path / 'root'), '--files', 'eval_200.json'
        )
    assert r.returncode == 2
    assert (
        f"eval_200.json: the hub resolved revision {PINNED['revision']} to commit {'e' * 40}: "
        "wrong revision refused" in r.stderr
    )
    assert not any(m == 'GET' and 'eval_200' in p for m, p in h.requests)
    assert not (tmp_path / 'root' / 'eval_200.jsonl').exists()


@pytest.mark.parametrize('name', ['eval_200.json', GIT_FILE])
def test_corrupted_file_refused(tmp_path, name):
    good = FILES[name]
    bad = good[:-3] + bytes(b ^ 1 for b in good[-3:])  # same size, different bytes
    with hub(corrupt={name: bad}) as h:
        r = run_prepare(
            h.endpoint, tmp_path, '--root', str(tmp_path / 'root'), '--files', 'eval_800.json', name
        )
    assert r.returncode == 2
    if name == GIT_FILE:
        kind, want, got = 'git-blob-sha1', git_blob_sha1(good), git_blob_sha1(bad)
    else:
        kind, want, got = (
            'lfs-sha256',
            hashlib.sha256(good).hexdigest(),
            hashlib.sha256(bad).hexdigest(),
        )
    assert (
        f"{name}: {kind} mismatch (the hub's hash of {resolve_url(h.endpoint, name)}): expected "
        f"{want}, got {got}" in r.stderr
    )
    root = tmp_path / 'root'
    assert (root / f'{name}.corrupt').read_bytes() == bad and not (root / name).exists()
    # the file prepared before it is recorded; the refused one is not, and asking for it gives the
    # command
    m = json.loads((root / 'manifest.json').read_text())
    assert list(m['files']) == ['eval_800.json']
    with pytest.raises(FileNotFoundError, match=f"memagent-prepare --root {root} --files {name}"):
        prepared_file(name, root)


def test_offline_mode_is_named(tmp_path):
    with hub() as h:
        control = run_prepare(
            h.endpoint, tmp_path, '--root', str(tmp_path / 'root'), '--files', 'eval_50.json'
        )
        assert control.returncode == 0, control.stderr  # the same server, HF_HUB_OFFLINE unset
        env = {
            **os.environ,
            'HF_HUB_OFFLINE': '1',
            'HF_ENDPOINT': h.endpoint,
            'PYTHONPATH': str(REPO),
        }
        r = subprocess.run(
            [
                sys.executable,
                '-c',
                'import sys; from memagent.data import prepare_cli; sys.exit(prepare_cli())',
                '--root',
                str(tmp_path / 'root2'),
                '--files',
                'eval_50.json',
                '--quiet',
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert r.returncode == 2 and 'HF_HUB_OFFLINE is set' in r.stderr and '--from DIR' in r.stderr


def test_from_dir_verifies_against_the_online_manifest(online, tmp_path):
    src, _, r, _, _, _ = online
    assert r.returncode == 0, r.stderr
    m = prepare(tmp_path / 'copy', source=src)  # src holds the files and the online manifest.json
    ref = json.loads((src / 'manifest.json').read_text())
    assert m['unverified'] == []
    for name in NAMES:
        f = m['files'][name]
        assert (
            f['verified'] and f['verification'] == f"manifest:{(src / 'manifest.json').resolve()}"
        )
        assert (f['sha256'], f['bytes'], f['url']) == (
            ref['files'][name]['sha256'],
            ref['files'][name]['bytes'],
            ref['files'][name]['url'],
        )
        assert f['source'] == str((src / name).resolve())
        # same converter, same bytes
        assert f['converted']['sha256'] == ref['files'][name]['converted']['sha256']
    # a copy that differs from the manifest is refused with both hashes
    bad = tmp_path / 'bad'
    shutil.copytree(src, bad, ignore=shutil.ignore_patterns('*.jsonl*', '.cache'))
    data = bytearray((bad / 'eval_800.json').read_bytes())
    data[5] ^= 1
    (bad / 'eval_800.json').write_bytes(bytes(data))
    with pytest.raises(
        PrepareError,
        match=(
            f"eval_800.json: sha256 mismatch \\(the manifest {bad / 'manifest.json'}\\): expected "
            f"{ref['files']['eval_800.json']['sha256']}, got {hashlib.sha256(data).hexdigest()}"
        ),
    ):
        prepare(tmp_path / 'root-bad', source=bad, files=['eval_800.json'])
    # --unverified does not override a mismatch
    with pytest.raises(PrepareError, match='eval_800.json: sha256 mismatch'):
        prepare(tmp_path / 'root-bad', source=bad, files=['eval_800.json'], unverified=True)


def test_from_dir_without_manifest_refused_unless_unverified(tmp_path):
    raw = tmp_path / 'raw'
    raw.mkdir()
    for name, data in FILES.items():
        (raw / name).write_bytes(data)
    with pytest.raises(
        PrepareError, match='hotpotqa_dev.parquet: no verified entry .* refused. Pass --unverified'
    ):
        prepare(tmp_path / 'root', source=raw, files=['hotpotqa_dev.parquet'])
    assert not (tmp_path / 'root' / 'hotpotqa_dev.jsonl').exists()
    r = subprocess.run(
        [
            sys.executable,
            '-c',
            'import sys; from memagent.data import prepare_cli; sys.exit(prepare_cli())',
            '--root',
            str(tmp_path / 'root'),
            '--from',
            str(raw),
            '--unverified',
            '--quiet',
        ],
        env={**os.environ, 'PYTHONPATH': str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert f"UNVERIFIED: {', '.join(NAMES)}" in r.stdout
    m = json.loads((tmp_path / 'root' / 'manifest.json').read_text())
    assert m['unverified'] == NAMES
    assert all(
        f['verified'] is False and f['verification'] == 'unverified' for f in m['files'].values()
    )
    assert m['files']['eval_50.json']['sha256'] == hashlib.sha256(FILES['eval_50.json']).hexdigest()
    # an unverified manifest cannot vouch for another copy
    with pytest.raises(PrepareError, match='eval_50.json: no verified entry'):
        prepare(tmp_path / 'root2', source=tmp_path / 'root', files=['eval_50.json'])


def test_missing_file_error_prints_the_command(tmp_path, monkeypatch):
    root = tmp_path / 'empty root'
    with pytest.raises(FileNotFoundError) as e:
        prepared_file('eval_800.json', root)
    assert f"run:\n  memagent-prepare --root '{root}' --files eval_800.json" in str(e.value)
    monkeypatch.setenv('MEMAGENT_DATA_ROOT', str(tmp_path / 'env-root'))
    with pytest.raises(
        FileNotFoundError,
        match=f"memagent-prepare --root {tmp_path / 'env-root'} --files hotpotqa_train_32k.parquet",
    ):
        prepared_file('hotpotqa_train_32k.parquet')
    with pytest.raises(FileNotFoundError, match='not a pinned data file'):
        prepared_file('eval_100.json', root)


@pytest.mark.parametrize(
    'train,eval_,needle',
    [
        # both pinned names resolve to the prepared copy and are read: the run stops at the overlap
        # check
        (
            'eval_50.json',
            'eval_50.json',
            'held-out split shares 2 question/answer pairs with training',
        ),
        (
            'eval_50.json',
            'eval_800.json',
            'run:\n  memagent-prepare --root {root} --files eval_800.json',
        ),
    ],
)
def test_train_notebook_resolves_pinned_names(tmp_path, train, eval_, needle):
    root, raw = tmp_path / 'root', tmp_path / 'raw'
    raw.mkdir()
    (raw / 'eval_50.json').write_bytes(FILES['eval_50.json'])
    prepare(root, source=raw, unverified=True, files=['eval_50.json'])
    cmd = [
        sys.executable,
        '-m',
        'papermill',
        str(REPO / 'nbs' / 'train.ipynb'),
        str(tmp_path / 'o.ipynb'),
        '--cwd',
        str(REPO),
        '-p',
        'preset',
        'tiny',
        '-p',
        'train_data',
        train,
        '-p',
        'eval_data',
        eval_,
        '-y',
        f'overrides: {{data.root: "{root}"}}',
        '-p',
        'out_dir',
        str(tmp_path / 'runs'),
        '-p',
        'report_dir',
        str(tmp_path / 'reports'),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = r.stderr + r.stdout
    assert r.returncode != 0 and needle.format(root=root) in out, out[-3000:]
