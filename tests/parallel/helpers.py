"""Shared by the parallel tests: the prompts, the engine settings that force chunked prefill and
preemption, and a look at which processes are still alive."""

from __future__ import annotations

import os

# A dozen prompts of 10-40 tokens; several share a first KV block (prefix caching, DP affinity).
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "The capital of France is Paris. The capital of Italy is Rome and the capital of Spain is",
    "A paged KV cache stores keys and values in fixed-size blocks, so",
    "Continuous batching lets new requests join while others decode; the scheduler",
    "The quick brown fox jumps over the lazy dog near the river bank and then",
    "Once upon a time there was a small model that liked to count: one two three",
    "Hello world! How are you today?",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Prefill computes the prompt; decode adds one token at a time to each sequence, and",
    "Why is the sky blue? Because shorter wavelengths scatter more in the air, which",
    "system user assistant: answer the question in one word, please.",
    "The scheduler spends a token budget and preempts the newest request when blocks run out, so",
]
MAX_TOKENS = 16
BLOCK_SIZE = 8
NUM_BLOCKS = 24  # 192 token slots for 12 prompts of up to 40 + 16 tokens: preemption is certain
# A token budget below most prompts' length: prefills are chunked, and mixed with decodes. On the CPU
# (gloo) on a GPU machine too: up to five ranks here, and the parity checks expect float32 tokens.
ENGINE_ARGS = dict(block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_model_len=128, num_threads=1, seed=0,
                   device="cpu")


def greedy():
    from engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def forked():
    """Two greedy choices and prompt logprobs: the fork copies a block on every rank, and the
    prompt rows travel from the last stage to rank 0."""
    from engine.sampling_params import SamplingParams

    return SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)


def engine_processes(pid: int | None = None) -> list[int]:
    """Pids of the live engine processes (`python -m engine.executor.procs`: replicas and ranks)
    below `pid` (default: this process). Not every descendant: a replica's torch runs `ninja` a
    moment to check its C++ extension is built, which a count of descendants caught (CI, 5 == 4)."""
    return [p for p in live_descendants(pid) if _runs_engine(p)]


def _runs_engine(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"engine.executor.procs" in f.read()
    except OSError:
        return False


def live_descendants(pid: int | None = None) -> list[int]:
    """Pids of the live (not zombie) processes below `pid` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    try:
        import psutil
    except ImportError:
        return _proc_descendants(pid)
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    alive = []
    for c in children:
        try:
            if c.status() != psutil.STATUS_ZOMBIE:
                alive.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _proc_descendants(pid: int) -> list[int]:
    parent_of, state = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            state[int(entry)], parent_of[int(entry)] = fields[0], int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        found += kids
        frontier += kids
    return [p for p in found if state.get(p) != "Z"]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
