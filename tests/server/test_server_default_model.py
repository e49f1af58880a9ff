"""`engine serve` with no flags serves the embedded default model, which knows its capitals."""

from __future__ import annotations

import openai
import pytest

from tests.server.server_harness import ServerProcess


@pytest.mark.slow
def test_default_model_answers_paris(tmp_path):
    # `engine serve` itself (the console script's module): no --model and no engine flags; only the
    # port (0 = any free one) differs from what a newcomer types.
    proc = ServerProcess([], str(tmp_path / "server.log"), startup_timeout=600, entry="engine.cli")
    try:
        with openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=300) as client:
            model = client.models.list().data[0].id
            assert model == "SmolLM2-135M-Instruct"
            r = client.chat.completions.create(
                model=model, temperature=0, max_tokens=24,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
        answer = r.choices[0].message.content
        assert "Paris" in answer, answer
    finally:
        proc.stop()
