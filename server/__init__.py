"""OpenAI-compatible HTTP server around an AsyncEngine (FastAPI + uvicorn).

`server.app.build_app(engine)` builds the app; `python -m server serve` (or `engine serve`)
runs it. Modules: protocol (OpenAI request/response types), routes/ (one file per endpoint
family), errors, auth, limits (body size), metrics (Prometheus), sse, prompts (tokenize and
check), logprobs (OpenAI logprob shapes), streams (prime / merge / disconnect helpers).
"""
