"""Finding and reading a model: a local path (loader.py) or a Hub id in the HF cache (hub.py), the
embedded default model and the per-user cache it lives in, checkpoint weights into a model (safetensors
slices, GGUF blocks kept as stored). It builds engine.models and never imports the runner above it."""
