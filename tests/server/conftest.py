"""A real `python -m engine serve` subprocess on 127.0.0.1, shared by the server tests."""

from __future__ import annotations

import pytest

from tests.server.server_harness import API_KEY, TINY_SERVER_ARGS, ServerProcess


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """The tiny model behind an API key; used by the feature, concurrency and bad-input tests."""
    log = str(tmp_path_factory.mktemp("server") / "server.log")
    proc = ServerProcess(["--model", tiny_model_dir, "--api-key", API_KEY, *TINY_SERVER_ARGS], log)
    yield proc
    proc.stop()


@pytest.fixture
def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def client(server):
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c
