"""A local HTTP server that answers the Hugging Face Hub's file requests for one dataset repository.

It serves what `huggingface_hub.hf_hub_download` and `get_hf_file_metadata` ask for, the way the hub
does:

- `HEAD`/`GET /datasets/{repo}/resolve/{revision}/{file}` with `X-Repo-Commit` (the commit the
  revision resolves to), `ETag` and `Content-Length`. A file stored in git gets its git blob SHA-1
  as `ETag` and its bytes. An LFS file is answered with a `302` to a second server (a different
  origin, standing for the hub's CDN) carrying `X-Linked-Etag` (the file's SHA-256) and
  `X-Linked-Size`, as the hub does; with `lfs_redirect=False` it is served directly with its SHA-256
  as `ETag`.
- `HEAD`/`GET /cdn/{sha256}` on the CDN server: the LFS file's bytes.
- Unknown repository, revision or file: `404` with the hub's `X-Error-Code` (`RepoNotFound`,
  `RevisionNotFound`, `EntryNotFound`).

`resolved_commit` makes the server report another commit than the one asked for; `corrupt` maps a
file name to bytes served instead of the real ones while the headers still advertise the real file's
hash and size. Every request is logged in `requests` as `(method, path)`.
"""

from __future__ import annotations
import hashlib, io, json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


def git_blob_sha1(data: bytes) -> str:
    "The git object id of a blob with these bytes (what the hub sends as ETag for a non-LFS file)."
    return hashlib.sha1(b'blob %d\0' % len(data) + data).hexdigest()


class FakeHub:
    "The hub for one dataset repository at one commit; `start()` it, read `endpoint`, `stop()` it."

    def __init__(
        self,
        repo_id: str,
        revision: str,
        files: dict,
        lfs=None,
        resolved_commit: str | None = None,
        corrupt: dict | None = None,
        lfs_redirect: bool = True,
    ):
        self.repo_id, self.revision, self.files = repo_id, revision, dict(files)
        self.lfs = set(files) if lfs is None else set(lfs)
        self.resolved_commit = resolved_commit or revision
        self.corrupt = dict(corrupt or {})
        self.lfs_redirect = lfs_redirect
        self.requests: list[tuple] = []
        self._servers = []

    # -- what is advertised and what is sent
    def sha256(self, name):
        return hashlib.sha256(self.files[name]).hexdigest()

    def body(self, name):
        return self.corrupt.get(name, self.files[name])

    def start(self) -> 'FakeHub':
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self._answer(head=True)

            def do_GET(self):
                self._answer(head=False)

            def _send(self, code, headers, body=b'', head=False):
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                if 'Content-Length' not in headers:
                    self.send_header('Content-Length', str(len(body)))
                self.end_headers()
                if not head and body:
                    self.wfile.write(body)

            def _error(self, code, err, msg, head, extra=None):
                body = json.dumps({'error': msg}).encode()
                self._send(
                    code,
                    {
                        'X-Error-Code': err,
                        'X-Error-Message': msg,
                        'Content-Type': 'application/json',
                        **(extra or {}),
                    },
                    body,
                    head,
                )

            def _answer(self, head):
                path = unquote(self.path.split('?', 1)[0])
                hub.requests.append((self.command, path))
                if path.startswith('/cdn/'):
                    sha = path[len('/cdn/') :]
                    name = next((n for n in hub.lfs if hub.sha256(n) == sha), None)
                    if name is None:
                        return self._send(404, {}, b'no such blob', head)
                    return self._send(
                        200,
                        {'Content-Type': 'application/octet-stream', 'ETag': f'"{sha}"'},
                        hub.body(name),
                        head,
                    )
                prefix = f'/datasets/{hub.repo_id}/resolve/'
                if not path.startswith(prefix):
                    return self._error(404, 'RepoNotFound', f'Repository not found: {path}', head)
                rev, _, name = path[len(prefix) :].partition('/')
                if rev not in (hub.revision, 'main'):
                    return self._error(404, 'RevisionNotFound', f'Invalid rev id: {rev}', head)
                commit = {'X-Repo-Commit': hub.resolved_commit}
                if name not in hub.files:
                    return self._error(
                        404, 'EntryNotFound', f'{name} does not exist on "{rev}"', head, commit
                    )
                data, body = hub.files[name], hub.body(name)
                if name in hub.lfs:
                    sha = hub.sha256(name)
                    if hub.lfs_redirect:
                        return self._send(
                            302,
                            {
                                **commit,
                                'ETag': f'"{git_blob_sha1(b"pointer " + sha.encode())}"',
                                'X-Linked-Etag': f'"{sha}"',
                                'X-Linked-Size': str(len(data)),
                                'Location': f'{hub.cdn}/cdn/{sha}',
                            },
                            b'',
                            head,
                        )
                    etag = sha
                else:
                    etag = git_blob_sha1(data)
                self._send(
                    200,
                    {
                        **commit,
                        'ETag': f'"{etag}"',
                        'Content-Type': 'application/octet-stream',
                        'Content-Length': str(len(body)),
                        'Accept-Ranges': 'bytes',
                    },
                    body,
                    head,
                )

        for _ in range(2):  # the hub, and the CDN on another origin
            srv = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self._servers.append(srv)
        self.endpoint = f'http://127.0.0.1:{self._servers[0].server_address[1]}'
        self.cdn = f'http://127.0.0.1:{self._servers[1].server_address[1]}'
        return self

    def stop(self):
        for s in self._servers:
            s.shutdown()
            s.server_close()
        self._servers = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *a):
        self.stop()


def pinned_format_files(names_formats: dict) -> dict:
    """Tiny files in the pinned formats: verl training parquet rows (3 per file) and RULER-HQA
    `.json` lists (2 rows)."""
    import pyarrow as pa, pyarrow.parquet as pq

    out = {}
    for name, fmt in names_formats.items():
        stem = name.rsplit('.', 1)[0]
        if fmt == 'parquet':
            rows = [
                {
                    'data_source': 'hotpotqa',
                    'prompt': [{'role': 'user', 'content': f'{stem} question {i}?'}],
                    'context': (
                        f'Document 1:\nTitle {i}\n{stem} fact {i}.\n\nDocument 2:\nOther\nFiller.'
                    ),
                    'ability': 'memory',
                    'reward_model': {'style': 'rule', 'ground_truth': [f'answer {i}']},
                    'extra_info': {'index': i, 'question': f'{stem} question {i}?', 'num_docs': 2},
                }
                for i in range(3)
            ]
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(rows), buf)
            out[name] = buf.getvalue()
        elif fmt == 'ruler':
            rows = [
                {
                    '_id': f'{stem}-{i}',
                    'input': f'{stem} question {i}?',
                    'answers': [f'answer {i}', f'alias {i}'],
                    'context': f'Document 1:\nA\nx.\n\nDocument 2:\nB\n{stem} fact {i}.',
                    'num_docs': 2,
                }
                for i in range(2)
            ]
            out[name] = json.dumps(rows, ensure_ascii=False).encode()
        else:
            raise ValueError(f'{name}: unknown format {fmt!r}')
    return out
