"""Load tests: a Locust file for OpenAI-compatible servers and a headless runner (`python -m loadtest`)."""
