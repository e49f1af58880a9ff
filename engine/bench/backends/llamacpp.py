"""llama.cpp as a peer: single-sequence decode through llama-cpp-python, and the facts a
launched `llama-server` needs (which GGUF file, which binary, how many slots, how much context).

llama.cpp runs GGUF files only, so the bench needs the GGUF behind `--model`: `--llamacpp-gguf`
when given, else `--model` itself when it is a .gguf file, else the default model's Q4_1 file
when `--model` is the default model (the folder pagewise converts from that same file).

Neither llama-cpp-python nor llama.cpp ships CPU binaries for every machine: both are built
from the llama-cpp-python source package by benchmarks/llamacpp/build.sh (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import shutil

from engine.bench.common import peer_threads
from engine.bench.datasets import SampleRequest

BUILD_SCRIPT = "benchmarks/llamacpp/build.sh"
# Where build.sh puts the binaries by default, in the order it picks them.
BUILD_DIRS = ("/opt/llamacpp", os.path.join(os.path.expanduser("~"), ".cache", "pagewise", "llamacpp"))
SERVER_BINARY = "llama-server"
# llama.cpp pads each slot's context to a multiple of this (llama-context.cpp, GGML_PAD(n_ctx_seq, 256)).
CTX_PAD = 256

INSTALL_HINT = (f"build llama.cpp and llama-cpp-python from the llama-cpp-python source package: "
                f"{BUILD_SCRIPT} [DEST] (docs/benchmarks.md, 'llama.cpp as a peer')")


class LlamaCppUnavailable(RuntimeError):
    pass


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def find_server(path: str | None) -> str:
    """The llama-server binary: --llamacpp-server, else $LLAMACPP_SERVER, else PATH, else build.sh's
    default folders. Raises LlamaCppUnavailable, saying how to build it, when there is none."""
    if path:
        exe = path if os.sep in path else shutil.which(path)
        if not exe or not os.path.isfile(exe) or not os.access(exe, os.X_OK):
            raise LlamaCppUnavailable(f"--llamacpp-server {path}: no such executable; {INSTALL_HINT}, then pass "
                                      f"--llamacpp-server DEST/bin/{SERVER_BINARY}")
        return os.path.abspath(exe)
    candidates = [os.environ.get("LLAMACPP_SERVER"), shutil.which(SERVER_BINARY)]
    candidates += [os.path.join(d, "bin", SERVER_BINARY) for d in BUILD_DIRS]
    for exe in candidates:
        if exe and os.path.isfile(exe) and os.access(exe, os.X_OK):
            return os.path.abspath(exe)
    raise LlamaCppUnavailable(f"no {SERVER_BINARY} found (not on PATH, nor in {', '.join(BUILD_DIRS)}); "
                              f"{INSTALL_HINT}, or pass --llamacpp-server PATH")


def _is_default_model_folder(model: str) -> bool:
    from engine.loading.default_model import DEFAULT_MODEL_NAME, default_model_path
    from engine.loading.user_cache import cache_dir

    real = os.path.realpath(model)
    # A cheap test first: default_model_path() converts the model when it is not yet cached,
    # which a folder the user named must not cause.
    if (os.path.dirname(real) != os.path.realpath(cache_dir())
            or not os.path.basename(real).startswith(DEFAULT_MODEL_NAME + "-")):
        return False
    return real == os.path.realpath(default_model_path())


def resolve_gguf(args) -> str:
    """The GGUF file llama.cpp runs, as an absolute path; ValueError naming the flag when there is none."""
    from engine.loading.default_model import default_gguf_path

    given = getattr(args, "llamacpp_gguf", None)
    if given:
        path = os.path.abspath(os.path.expanduser(given))
        if not os.path.isfile(path):
            raise ValueError(f"--llamacpp-gguf {given}: no such file")
        return path
    model = getattr(args, "model", None)
    if not model:
        return default_gguf_path()
    model = os.path.expanduser(model)
    if model.endswith(".gguf") and os.path.isfile(model):
        return os.path.abspath(model)
    if os.path.isdir(model) and _is_default_model_folder(model):
        return default_gguf_path()
    raise ValueError(f"llama.cpp runs GGUF files and --model {model} is not one: pass --llamacpp-gguf PATH "
                     "(the same weights as a .gguf file)")


def server_slots(args) -> int:
    """Parallel slots of a launched llama-server: the highest --max-concurrency (every request at
    once when unlimited), at most --max-num-seqs, the most sequences pagewise runs at once."""
    levels = args.concurrency_levels  # [None] when --max-concurrency is not given
    wanted = args.num_prompts if None in levels else max(levels)
    return max(1, min(wanted, args.max_num_seqs))


def slot_context(args, requests: list[SampleRequest]) -> int:
    """Context tokens of one llama-server slot: --max-model-len when given, else the longest request.

    +2: llama-server stops a sequence once its tokens + 1 reach the slot's context
    (server-context.cpp), and the last sampled token is never fed back. Padded as llama.cpp pads
    it, so the command line shows the context the server really has."""
    if args.max_model_len:
        return round_up(args.max_model_len, CTX_PAD)
    longest = max(r.prompt_len + r.output_len for r in requests)
    return round_up(longest + 2, CTX_PAD)


def require_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        import sys

        raise LlamaCppUnavailable(f"llama-cpp-python is not importable from this Python ({sys.executable}): "
                                  f"{INSTALL_HINT} (import error: {e})") from None
    return llama_cpp


class LlamaCppBackend:
    """llama-cpp-python's `Llama`, one sequence at a time: greedy, EOS ignored (its `generate`
    never stops at EOS; only `create_completion` does), every request from an empty KV cache."""

    name = "llamacpp"

    def __init__(self, args):
        self.args = args
        self.llm = None
        self.gguf = None

    def n_ctx(self) -> int:
        a = self.args
        if a.max_model_len:
            return a.max_model_len
        # latency: every request has exactly input_len + output_len tokens; the warm-up fewer.
        return round_up(a.input_len + a.output_len + 2, CTX_PAD)

    def load(self) -> None:
        llama_cpp = require_llama_cpp()
        a = self.args
        self.gguf = resolve_gguf(a)
        # flash_attn: llama.cpp's own default ("auto") turns it on for the CPU backend; the
        # binding's default is off, which would make this peer slower than llama.cpp itself.
        self.llm = llama_cpp.Llama(model_path=self.gguf, n_ctx=self.n_ctx(), n_threads=peer_threads(a),
                                   n_threads_batch=peer_threads(a), seed=a.seed, flash_attn=True, verbose=False)

    def generate(self, requests: list[SampleRequest], use_tqdm: bool = True) -> list[list[int]]:
        out = []
        for r in requests:
            self.llm.reset()  # no prefix reuse between requests: each one is a fresh sequence
            tokens = []
            for token in self.llm.generate(r.prompt_token_ids, temp=0.0, repeat_penalty=1.0, reset=False):
                tokens.append(token)
                if len(tokens) == r.output_len:
                    break
            out.append(tokens)
        return out

    def info(self) -> dict:
        import llama_cpp

        return {"llama_cpp_python": llama_cpp.__version__, "gguf": self.gguf, "n_ctx": self.llm.n_ctx(),
                "flash_attn": True, "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
