"""A local HTTP server speaking the Hub endpoints that `huggingface_hub` 2.x calls for zoo's Hub source, so that
tests drive the real client (HF_ENDPOINT pointed here) and never touch the internet:

- `GET /api/models?filter=&search=&author=&limit=` with Link-header paging;
- `GET /api/models/{repo}/revision/{rev}` (model info: sha, siblings with sizes and LFS hashes, card data, ...);
- `GET /api/models/{repo}/tree/{rev}` (what snapshot_download lists);
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}` with X-Repo-Commit, ETag, and for LFS files a 302 to a CDN on another
  origin (`localhost` instead of `127.0.0.1`) carrying X-Linked-Etag and X-Linked-Size, as the Hub does;
- errors with the X-Error-Code the client maps to RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError.

Faults are set per repo (FakeRepo fields) or server-wide (`storm`).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlencode, urlparse

TOKEN = "hf_test_token"
#: files with these suffixes are stored in LFS (as on the Hub: weights)
LFS_SUFFIXES = (".safetensors", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]


@dataclass
class FakeRepo:
    commits: list[Commit]
    card_data: dict[str, object] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    downloads: int = 7
    likes: int = 3
    pipeline_tag: str | None = None
    library_name: str | None = "peft"
    #: listed by /api/models but answering 404 to everything else (deleted mid-crawl)
    gone: bool = False
    gated: bool = False  # files need the token (GatedRepo without it)
    private: bool = False  # everything needs the token (RepoNotFound, 401, without it)
    #: sizes the listings declare instead of the real ones (a huge file)
    declared_sizes: dict[str, int] = field(default_factory=dict)
    #: bytes the CDN serves instead of the listed ones (the file changed after it was listed)
    served: dict[str, bytes] = field(default_factory=dict)

    @property
    def head(self) -> Commit:
        return self.commits[-1]

    def commit(self, files: dict[str, bytes]) -> str:
        """A new commit on main; returns its sha."""
        sha = hashlib.sha1(repr((len(self.commits), sorted((k, git_blob_id(v)) for k, v in files.items()))).encode()).hexdigest()
        self.commits.append(Commit(sha, dict(files)))
        return sha

    @classmethod
    def of_files(cls, files: dict[str, bytes], **kw: object) -> FakeRepo:
        repo = cls([], **kw)  # type: ignore[arg-type]
        repo.commit(files)
        return repo

    @classmethod
    def from_dir(cls, path: Path, extra: dict[str, bytes] | None = None, **kw: object) -> FakeRepo:
        files = {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
        return cls.of_files({**files, **(extra or {})}, **kw)


class HubServer:
    """`with HubServer() as hub:` serves `hub.repos` (repo id → FakeRepo) at `hub.url`; `hub.requests` records
    (method, path) of every request. `storm`: answer that many requests (-1: all) with 429 and `retry_after`."""

    def __init__(self, page_size: int = 2) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []
        self.storm = 0
        self.retry_after = "0"
        self.page_size = page_size
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                server.answer(self, body=False)

            def do_GET(self) -> None:
                server.answer(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn = f"http://localhost:{self.port}/cdn"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def count(self, method: str, part: str) -> int:
        """Requests of this method whose path contains `part`."""
        return sum(1 for m, p in self.requests if m == method and part in p)

    # --- dispatch ------------------------------------------------------------------------------------

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        url = urlparse(h.path)
        path, query = unquote(url.path), parse_qs(url.query)
        with self._lock:
            self.requests.append((h.command, path))
            storm = self.storm != 0
            if self.storm > 0:
                self.storm -= 1
        if storm:
            return _send(h, 429, b'{"error": "rate limited"}', {"Retry-After": self.retry_after}, body)
        authorized = h.headers.get("Authorization") == f"Bearer {TOKEN}"
        parts = path.strip("/").split("/")
        if path == "/api/models":
            return self._list(h, query, body)
        if path.startswith("/cdn/"):
            return self._cdn(h, parts[1], parts[2], body)
        if parts[:2] == ["api", "models"] and len(parts) == 4:
            parts += ["revision", "main"]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo = self._repo(h, "/".join(parts[2:4]), authorized, body, files=False)
            commit = repo and self._commit(h, repo, parts[5], body)
            if repo and commit:
                if parts[4] == "revision":
                    return self._info(h, "/".join(parts[2:4]), repo, commit, body)
                return self._tree(h, repo, commit, body)
            return None
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo(h, "/".join(parts[:2]), authorized, body, files=True)
            commit = repo and self._commit(h, repo, parts[3], body)
            if repo and commit:
                return self._file(h, "/".join(parts[:2]), repo, commit, "/".join(parts[4:]), body)
            return None
        return _send(h, 404, b'{"error": "not found"}', {}, body)

    # --- endpoints -----------------------------------------------------------------------------------

    def _list(self, h: BaseHTTPRequestHandler, query: dict[str, list[str]], body: bool) -> None:
        found = [
            (rid, r)
            for rid, r in sorted(self.repos.items())
            if not r.private
            and all(f in r.tags or f == r.library_name for f in query.get("filter", []))
            and all(s.lower() in rid.lower() for s in query.get("search", []))
            and all(rid.split("/")[0] == a for a in query.get("author", []))
        ]
        start = int(query.get("cursor", ["0"])[0])
        size = min(self.page_size, int(query.get("limit", [str(self.page_size)])[0]))
        page = found[start : start + size]
        headers = {"Content-Type": "application/json"}
        if start + size < len(found):
            rest = {k: v for k, v in query.items() if k != "cursor"} | {"cursor": [str(start + size)]}
            headers["Link"] = f'<{self.url}/api/models?{urlencode(rest, doseq=True)}>; rel="next"'
        items = [{"id": rid, "author": rid.split("/")[0], "tags": r.tags, "library_name": r.library_name} for rid, r in page]
        _send(h, 200, json.dumps(items).encode(), headers, body)

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, authorized: bool, body: bool, files: bool) -> FakeRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None or repo.gone or (repo.private and not authorized):
            status = 401 if repo is not None and repo.private else 404
            _send(h, status, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            return None
        if repo.gated and files and not authorized:
            _send(h, 401, b'{"error": "Access to this model is restricted"}', {"X-Error-Code": "GatedRepo"}, body)
            return None
        return repo

    def _commit(self, h: BaseHTTPRequestHandler, repo: FakeRepo, revision: str, body: bool) -> Commit | None:
        if revision == "main":
            return repo.head
        found = next((c for c in repo.commits if c.sha == revision), None)
        if found is None:
            _send(h, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, body)
        return found

    def _size(self, repo: FakeRepo, name: str, data: bytes) -> int:
        return repo.declared_sizes.get(name, len(data))

    def _info(self, h: BaseHTTPRequestHandler, repo_id: str, repo: FakeRepo, commit: Commit, body: bool) -> None:
        siblings = []
        for name, data in commit.files.items():
            entry: dict[str, object] = {"rfilename": name, "size": self._size(repo, name, data), "blobId": git_blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"size": self._size(repo, name, data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(entry)
        info = {
            "id": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit.sha,
            "private": repo.private,
            "gated": "auto" if repo.gated else False,
            "downloads": repo.downloads,
            "likes": repo.likes,
            "tags": repo.tags,
            "pipeline_tag": repo.pipeline_tag,
            "library_name": repo.library_name,
            "cardData": repo.card_data,
            "lastModified": "2026-11-01T00:00:00.000Z",
            "siblings": siblings,
        }
        _send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

    def _tree(self, h: BaseHTTPRequestHandler, repo: FakeRepo, commit: Commit, body: bool) -> None:
        entries = []
        for name, data in commit.files.items():
            entry: dict[str, object] = {"type": "file", "path": name, "size": self._size(repo, name, data), "oid": git_blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": self._size(repo, name, data), "pointerSize": 134}
            entries.append(entry)
        _send(h, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body)

    def _file(self, h: BaseHTTPRequestHandler, repo_id: str, repo: FakeRepo, commit: Commit, name: str, body: bool) -> None:
        data = commit.files.get(name)
        if data is None:
            return _send(h, 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit.sha}, body)
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{git_blob_id(data)}"'}
        if not name.endswith(LFS_SUFFIXES):
            return _send(h, 200, data, headers, body)
        digest = hashlib.sha256(data).hexdigest()
        headers |= {
            "X-Linked-Etag": f'"{digest}"',
            "X-Linked-Size": str(self._size(repo, name, data)),
            "Location": f"{self.cdn}/{repo_id.replace('/', '--')}--{digest}/{name.replace('/', '--')}",
        }
        _send(h, 302, b"", headers, body)

    def _cdn(self, h: BaseHTTPRequestHandler, key: str, fname: str, body: bool) -> None:
        repo_key, _, digest = key.rpartition("--")
        for rid, repo in self.repos.items():
            if rid.replace("/", "--") != repo_key:
                continue
            for commit in repo.commits:
                for name, data in commit.files.items():
                    if name.replace("/", "--") == fname and hashlib.sha256(data).hexdigest() == digest:
                        return _send(h, 200, repo.served.get(name, data), {"ETag": f'"{digest}"'}, body)
        _send(h, 404, b"no such object", {}, body)


def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
    h.send_response(status)
    for k, v in headers.items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if body:
        h.wfile.write(data)
