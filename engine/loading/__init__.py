"""Finding and reading a model: a local path, the HF cache or a Hub id (loader.py), the embedded
default model and the per-user cache it lives in, checkpoint weights into a model (safetensors
slices, GGUF blocks kept as stored). It builds engine.models and never imports the runner above it."""
