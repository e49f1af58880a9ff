"""/openapi.json against the server that serves it (schemathesis, stateless): every operation, with
requests drawn from the document and across its edges. No answer is a 5xx, and every answer's
status code, media type and body (each event of a stream too) is one the document declares."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from tests.server.server_harness import API_KEY, TINY_SERVER_ARGS, ServerProcess

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def documented_server(tiny_model_dir, tmp_path_factory):
    """The tiny model with a 64-token context: whatever max_tokens a request draws, it ends quickly."""
    log = str(tmp_path_factory.mktemp("openapi") / "server.log")
    proc = ServerProcess(["--model", tiny_model_dir, "--api-key", API_KEY, "--max-model-len", "64",
                          *TINY_SERVER_ARGS], log)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def document(documented_server):
    return schemathesis.openapi.from_url(documented_server.url + "/openapi.json", headers=AUTH, timeout=30)


schema = schemathesis.pytest.from_fixture("document")


@schema.parametrize()
@settings(max_examples=20, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_the_server_answers_as_its_document_says(case, documented_server):
    case.call_and_validate(base_url=documented_server.url, headers=AUTH, checks=CHECKS, timeout=60)


def test_the_server_serves_on_after_the_run(documented_server):
    with httpx.Client(base_url=documented_server.url, headers=AUTH, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
