"""Hub ids as local paths. `--model ORG/NAME` (with `--revision`), `--tokenizer ORG/NAME` and a GGUF
file (`ORG/NAME:FILE.gguf` or `--gguf-file`) are read from the local Hugging Face cache, in the layout
huggingface_hub writes (models--ORG--NAME/refs/<revision> holds a commit, snapshots/<commit>/ the
files), so a model another tool downloaded is served as it is. What the cache lacks is downloaded
into it with huggingface_hub when the network is allowed (HF_HUB_OFFLINE unset): config, tokenizer
and safetensors files only. A local path of the same name always wins. Offline and not cached is a
HubError (a ValueError: one line at the CLI) saying what to run.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re

from engine.config import hub_id

logger = logging.getLogger(__name__)

# huggingface_hub's reading of HF_HUB_OFFLINE (and of transformers' older name for it).
_TRUE = {"1", "ON", "YES", "TRUE"}
# Everything a model folder holds besides its weights: config.json, generation_config.json, the
# tokenizer's files, a shard index, a chat template. Subfolders (onnx/, original/) are left out.
SMALL_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class HubError(ValueError):
    """A Hub id that cannot be read or downloaded; the message says what to run instead."""


def cache_dir(download_dir: str | None = None) -> str:
    """--download-dir, else $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (as
    huggingface_hub finds it, $XDG_CACHE_HOME included)."""
    if download_dir:
        return os.path.expanduser(download_dir)
    if d := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(d)
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def offline() -> bool:
    return any(os.environ.get(name, "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def model_path(config) -> str | None:
    """The local path of an EngineConfig's model: itself when it is a path (or None, the default
    model), else the Hub snapshot folder or .gguf file it names, downloaded first if need be."""
    hub = config.model_hub_id()
    if hub is None:
        return config.model
    repo, gguf_file = hub
    if gguf_file is not None:
        return os.path.join(snapshot(repo, config.revision, config.download_dir, (("gguf", gguf_file),), "--model"),
                            gguf_file)
    kind = ("model", "tokenizer") if config.tokenizer is None else ("model",)
    return snapshot(repo, config.revision, config.download_dir, kind, "--model")


def tokenizer_path(config) -> str | None:
    """The local path of an EngineConfig's --tokenizer (None: the model's own). --revision applies
    to a tokenizer of the model's own repository only."""
    if config.tokenizer is None or os.path.exists(config.tokenizer):
        return config.tokenizer
    repo, _ = hub_id(config.tokenizer)
    model = config.model_hub_id()
    revision = config.revision if model is not None and model[0] == repo else None
    return snapshot(repo, revision, config.download_dir, ("tokenizer",), "--tokenizer")


def resolve_config_dir(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A folder holding `model`'s config.json: `model` itself when it is a local path, else its Hub
    snapshot (only config.json downloaded, when the cache lacks it). For `engine plan`, which reads
    nothing else."""
    if os.path.exists(os.path.expanduser(model)) or hub_id(model) is None:
        return os.path.expanduser(model)
    repo, gguf_file = hub_id(model)
    if gguf_file is not None:
        raise HubError(f"--model {model}: a GGUF file has no config.json, which the plan reads: pass the id of the "
                       "model it was converted from (ORG/NAME) or its folder")
    return snapshot(repo, revision, download_dir, ("config",), "--model")


def snapshot(repo: str, revision: str | None, download_dir: str | None, kinds: tuple, flag: str) -> str:
    """The snapshot folder of `repo` at `revision` holding what `kinds` need ("model": config.json and
    safetensors weights, "tokenizer", "config", ("gguf", FILE)): the cached one, else downloaded."""
    cache = cache_dir(download_dir)
    folder = cached_snapshot(repo, revision, cache)
    lacks = missing(folder, kinds) if folder else "neither a local path nor in the Hugging Face cache"
    if lacks is None:
        return folder
    if offline():
        where = f" at revision {revision}" if revision else ""
        command = download_command(repo, revision, download_dir, kinds)
        raise HubError(f"{flag} {repo}{where}: {lacks} ({os.path.join(cache, _repo_folder(repo))}) and HF_HUB_OFFLINE "
                       f"is set, so nothing is downloaded: run `{command}`, or unset HF_HUB_OFFLINE to let the engine "
                       "download it")
    return _download(repo, revision, cache, kinds, flag)


def cached_snapshot(repo: str, revision: str | None, cache: str) -> str | None:
    """snapshots/<commit> of `repo` for a branch or tag (refs/<revision> names its commit) or a commit
    itself, when the cache holds that folder."""
    root = os.path.join(cache, _repo_folder(repo))
    revision = revision or "main"
    ref = os.path.join(root, "refs", revision)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    elif re.fullmatch(r"[0-9a-f]{40}", revision):
        commit = revision
    else:
        return None
    folder = os.path.join(root, "snapshots", commit)
    return folder if os.path.isdir(folder) else None


def missing(folder: str, kinds: tuple) -> str | None:
    """What the snapshot folder lacks for `kinds`, in words; None when it holds it all."""
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(folder, name))

    for kind in kinds:
        if kind in ("model", "config") and not has("config.json"):
            return "the cached snapshot has no config.json"
        if kind == "tokenizer" and not any(has(name) for name in TOKENIZER_FILES):
            return f"the cached snapshot has no tokenizer ({' or '.join(TOKENIZER_FILES)})"
        if kind == "model":
            shards = _indexed_shards(folder)
            if shards is not None and not all(has(name) for name in shards):
                return f"the cached snapshot lacks some of the {len(shards)} safetensors shards its index names"
            if not glob.glob(os.path.join(glob.escape(folder), "*.safetensors")):
                return "the cached snapshot has no *.safetensors weights"
        if isinstance(kind, tuple) and not has(kind[1]):
            return f"the cached snapshot has no {kind[1]}"
    return None


def download_command(repo: str, revision: str | None, download_dir: str | None, kinds: tuple) -> str:
    """The huggingface_hub command that puts what `kinds` need into the cache."""
    files = next((f" {kind[1]}" for kind in kinds if isinstance(kind, tuple)), "")
    if "config" in kinds:
        files = " config.json"
    options = (f" --revision {revision}" if revision else "") + (f" --cache-dir {download_dir}" if download_dir else "")
    return f"hf download {repo}{files}{options}"


def _repo_folder(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def _indexed_shards(folder: str) -> list[str] | None:
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return None
    try:
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
        return None  # the loader names a broken index with what to do


def _download(repo: str, revision: str | None, cache: str, kinds: tuple, flag: str) -> str:
    """Download what `kinds` need with huggingface_hub (its progress bars on stderr): the small files
    first, then the weights, the shards a sharded checkpoint's index names and no others."""
    logger.info("downloading %s%s from the Hugging Face Hub into %s", repo, f" ({revision})" if revision else "", cache)
    gguf = next((kind[1] for kind in kinds if isinstance(kind, tuple)), None)
    if gguf is not None:
        return _snapshot_download(repo, revision, cache, [gguf], None, flag)
    if kinds == ("config",):
        return _snapshot_download(repo, revision, cache, ["config.json"], None, flag)
    folder = _snapshot_download(repo, revision, cache, SMALL_FILES, ["*/*"], flag)
    if "model" in kinds:
        commit = os.path.basename(folder)  # the same commit for the weights, whatever the branch does meanwhile
        shards = _indexed_shards(folder)
        folder = _snapshot_download(repo, commit, cache, shards or ["*.safetensors"], ["*/*"], flag)
    lacks = missing(folder, kinds)
    if lacks is not None:
        lacks = lacks.replace("the cached snapshot", f"the repository{f' at {revision}' if revision else ''}")
        raise HubError(f"{flag} {repo}: {lacks}: the engine reads config.json, a tokenizer and *.safetensors "
                       "weights (or one .gguf file: ORG/NAME:FILE.gguf)")
    return folder


def _snapshot_download(repo: str, revision: str | None, cache: str, allow: list[str], ignore: list[str] | None,
                       flag: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        # HF_ENDPOINT read now, not only when huggingface_hub was imported: a mirror set by the caller holds.
        return snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=allow,
                                 ignore_patterns=ignore, endpoint=os.environ.get("HF_ENDPOINT") or None)
    except GatedRepoError:
        raise HubError(f"{flag} {repo} is gated: accept its terms on huggingface.co, then log in with `hf auth "
                       "login` (or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{flag} {repo} has no revision {revision!r}: pass a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise HubError(f"{flag} {repo} is neither a local path nor a model on the Hugging Face Hub (a private one "
                       "needs `hf auth login` or HF_TOKEN)") from None
    except Exception as e:  # no network, a proxy, a server error: huggingface_hub's words, one line
        why = (str(e).strip().splitlines() or [type(e).__name__])[0].removeprefix("Got: ")
        raise HubError(f"{flag} {repo} could not be downloaded ({why}): check the network, or download it where "
                       f"there is one with `hf download {repo}` and copy the cache folder {cache}") from None
