"""The engine's front end: the offline LLM API, AsyncEngine (the server's engine thread), the
output processor that turns core outputs into text, and data-parallel replicas behind a router.
It builds the executor and the core that steps it (startup.py) and is the only part a user calls."""
