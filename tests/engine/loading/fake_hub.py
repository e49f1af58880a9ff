"""A Hugging Face Hub on a local socket, answering the few routes huggingface_hub's snapshot_download
calls (the model's revision, its file tree, each file's HEAD and GET), so that tests write a Hub cache
with huggingface_hub itself and watch which files the engine downloads, with no network."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import urllib.parse


class FakeHub(http.server.ThreadingHTTPServer):
    """`repos`: ORG/NAME -> {revision: (commit, {file name: bytes})}; `fetched` lists the files GET."""

    def __init__(self, repos: dict):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.fetched: list[str] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    def lookup(self, repo: str, revision: str) -> tuple[str, dict] | None:
        for commit, files in self.repos.get(repo, {}).values():
            if revision == commit:
                return commit, files
        return self.repos.get(repo, {}).get(revision)


def folder_files(folder: str, **extra: bytes) -> dict[str, bytes]:
    """A folder's files as a repository's, plus `extra` ones (name -> bytes)."""
    files = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            files[name] = f.read()
    return {**files, **extra}


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args) -> None:
        pass

    def _route(self):
        """("api", body) for the API routes, ("file", name, bytes, commit), or None (404)."""
        path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
        for repo in self.server.repos:
            api = f"/api/models/{repo}/"
            if path.startswith(api + "revision/") or path.startswith(api + "tree/"):
                kind, _, revision = path[len(api):].partition("/")
                found = self.server.lookup(repo, revision)
                if found is None:
                    return None
                commit, files = found
                if kind == "revision":
                    return "api", {"id": repo, "sha": commit, "siblings": [{"rfilename": n} for n in files]}
                return "api", [{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                               for n, d in files.items()]
            if path.startswith(f"/{repo}/resolve/"):
                revision, _, name = path[len(f"/{repo}/resolve/"):].partition("/")
                found = self.server.lookup(repo, revision)
                if found is not None and name in found[1]:
                    return "file", name, found[1][name], found[0]
        return None

    def _answer(self, with_body: bool) -> None:
        route = self._route()
        if route is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if route[0] == "api":
            body = json.dumps(route[1]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        else:
            _, name, body, commit = route
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
            if with_body:
                self.server.fetched.append(name)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(True)

    def do_HEAD(self) -> None:
        self._answer(False)
