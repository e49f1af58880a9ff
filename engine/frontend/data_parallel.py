"""Data parallel: data_parallel_size whole engine replicas (each may itself be TP x PP) in their
own processes, behind the core's interface (CoreClient), so that AsyncEngine (the server) and LLM drive
them exactly as they drive one core (engine.frontend.core_factory.start_core picks this front when dp > 1).
With one replica (EngineConfig.core_process) it is vLLM's process split: the engine core steps in a
process of its own while the front's process does HTTP, tokenization and detokenization.

The front offers the same check_request as EngineCore (its caller checks each request once), routes it (Router: least
loaded, with prefix affinity), sends it down the replica's pipe, and gathers every replica's
outputs and stats as they come. Replicas share nothing, so they need no process group; they
live on this node. A replica that dies, or whose step fails, stops the whole front with a
WorkerDiedError that names it: the server then answers 503 on /health and fails what was pending.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import time

from engine.core.admission import Limits, check_lora, check_request
from engine.distributed.layout import check_layout
from engine.executor.procs import ChildProcesses, WorkerDiedError
from engine.frontend.replica import replica_main
from engine.frontend.router import Router
from engine.loading.loader import source_for
from engine.outputs import CoreOutput

logger = logging.getLogger(__name__)

POLL_S = 0.005  # longest a step() waits for replica outputs before the caller gets control back
START_TIMEOUT_S = 600.0
# Stats that are not sums over replicas: recomputed from their parts.
_RATIOS = {"kv_cache_usage": ("num_used_blocks", "num_total_blocks"),
           "prefix_cache_hit_rate": ("prefix_cache_hits", "prefix_cache_queries")}


class DataParallelCore:
    """A CoreClient whose requests run on data_parallel_size replicas."""

    def __init__(self, config):
        self.config = config
        # config and tokenizer only (the replicas load weights); this tokenizer serves the chat route
        source = source_for(config)
        layout = check_layout(config, source.hf_config)
        self.tokenizer, self.model_name, self.eos_token_ids = source.tokenizer, source.name, source.eos_token_ids
        self.sampling_defaults = source.sampling_defaults
        self.vocab_size = source.hf_config.vocab_size
        n = config.data_parallel_size
        self.children = ChildProcesses()
        self.conns: list[multiprocessing.connection.Connection] = []
        self._dead: str | None = None
        try:
            gpus = _gpu_slices(config, n, layout.world_size)
            # core_process tells a lone replica that it is the core process (its log says so).
            replica_config = dataclasses.replace(config, data_parallel_size=1, core_process=n == 1)
            for i in range(n):
                ours, theirs = multiprocessing.Pipe()
                name = "pagewise-core" if n == 1 else f"pagewise-replica{i}"
                self.children.start(name, replica_main, i, replica_config, theirs.fileno(), gpus[i],
                                    pass_fds=(theirs.fileno(),))
                theirs.close()
                self.conns.append(ours)
            ready = [self._wait_ready(i) for i in range(n)]
        except BaseException:
            self.shutdown()
            raise
        self.max_model_len = min(r[1] for r in ready)
        self.limits = Limits.of(config, source.hf_config, self.max_model_len)
        self.replica_stats = [r[2] for r in ready]
        self.router = Router(n, config.block_size)
        self.owner: dict[str, int] = {}  # unfinished request -> its replica
        # Per replica, the adds sent that its stats do not show yet: (its count of adds once it has
        # this one, the request's sequences). They wait, as far as admission can tell.
        self.num_sent = [0] * n
        self.in_transit: list[collections.deque[tuple[int, int]]] = [collections.deque() for _ in range(n)]
        logger.info("data parallel: %d replicas of %d rank(s) each", n, layout.world_size)

    def _wait_ready(self, i: int) -> tuple:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.conns[i].poll(0.1):
            self.children.check()
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"{self._name(i)} did not start in {START_TIMEOUT_S:.0f}s")
        msg = self._recv(i)
        assert msg[0] == "ready", msg
        return msg

    # ---- the core's interface (CoreClient) -------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params,
                    arrival_time: float | None = None, lora_request=None) -> None:
        if request_id in self.owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        self.check_health()
        replica = self.router.choose(ids)
        self.owner[request_id] = replica
        self.num_sent[replica] += 1
        self.in_transit[replica].append((self.num_sent[replica], sampling_params.n))
        self._send(replica, ("add", request_id, ids, sampling_params, arrival_time, lora_request))

    def finish_choice(self, request_id: str, index: int, stop: str) -> None:
        """A stop string ended this choice: its replica frees it (and may have made a token or two
        past it meanwhile, which the front's output processor drops)."""
        if request_id in self.owner:
            self._send(self.owner[request_id], ("finish", request_id, index, stop))

    def check_request(self, ids: list[int], params, lora_request=None) -> None:
        check_request(ids, params, self.limits, lora_request)

    def check_lora(self, lora_request) -> None:
        check_lora(lora_request, self.limits)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Each replica reports its aborted requests once more, finished with reason "abort"."""
        by_replica: dict[int, list[str]] = {}
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self.owner:
                by_replica.setdefault(self.owner[rid], []).append(rid)
        for replica, ids in by_replica.items():
            self._send(replica, ("abort", ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.owner)

    def step(self) -> list[CoreOutput]:
        """Whatever the replicas have finished since the last call, waiting at most POLL_S for some."""
        self.check_health()
        outputs = []
        for conn in multiprocessing.connection.wait(self.conns, timeout=POLL_S):
            i = self.conns.index(conn)
            while conn.poll():
                outputs += self._handle(i, self._recv(i))
        return outputs

    def _handle(self, i: int, msg: tuple) -> list[CoreOutput]:
        kind = msg[0]
        if kind == "error":
            self._dead = f"{self._name(i)} failed: {msg[1]}"
            raise WorkerDiedError(self._dead)
        if kind == "rejected":
            _, rid, message = msg
            logger.error("%s could not take request %s: %s", self._name(i), rid, message)
            msg = ("step", [CoreOutput(rid, 0, finish_reason="abort", request_finished=True, error=message)],
                   self.replica_stats[i])
        _, outputs, stats = msg
        self.replica_stats[i] = stats
        transit = self.in_transit[i]
        while transit and transit[0][0] <= stats.get("num_requests_added", 0):
            transit.popleft()
        for out in outputs:
            if out.request_finished and self.owner.pop(out.request_id, None) is not None:
                self.router.finished(i)
        return outputs

    # ---- pipes -----------------------------------------------------------------------------

    def _send(self, i: int, msg: tuple) -> None:
        try:
            self.conns[i].send(msg)
        except OSError as e:
            raise self._lost(i, e) from e

    def _recv(self, i: int) -> tuple:
        try:
            return self.conns[i].recv()
        except (EOFError, OSError) as e:
            raise self._lost(i, e) from e

    def _name(self, i: int) -> str:
        return f"data-parallel replica {i}" if self.config.data_parallel_size > 1 else "the engine core process"

    def _lost(self, i: int, error: BaseException) -> WorkerDiedError:
        culprit = self.children.failure(wait_s=2.0)
        self._dead = f"{self._name(i)} is gone: {culprit or type(error).__name__}"
        return WorkerDiedError(self._dead)

    # ---- health, stats, shutdown -------------------------------------------------------------

    def check_health(self) -> None:
        if self._dead is None and self.children.failure():
            what = "data-parallel" if len(self.conns) > 1 else "the engine core process:"
            self._dead = f"{what} {self.children.failure()}"
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    def stats(self) -> dict:
        """Sums over the replicas (ratios recomputed from their parts), and each replica's own
        stats under "replicas" (with the requests routed to it), for per-replica metrics."""
        replicas = [dict(s, num_requests_routed=self.router.routed[i], healthy=self._dead is None)
                    for i, s in enumerate(self.replica_stats)]
        keys = {k for s in self.replica_stats for k, v in s.items() if isinstance(v, (int, float))}
        total = {k: sum(s.get(k, 0) for s in self.replica_stats) for k in keys - _RATIOS.keys()}
        for key, (part, whole) in _RATIOS.items():
            total[key] = total.get(part, 0) / total[whole] if total.get(whole) else 0.0
        for transit in self.in_transit:  # sent, not yet in a replica's stats: waiting
            total["num_waiting"] = total.get("num_waiting", 0) + len(transit)
            total["num_waiting_seqs"] = total.get("num_waiting_seqs", 0) + sum(n for _, n in transit)
        total["num_prefix_affinity_routes"] = self.router.affinity_hits
        total["replicas"] = replicas
        return total

    def shutdown(self) -> None:
        """Stop every replica (each stops its own workers); idempotent."""
        for i in range(len(self.conns)):
            try:
                self.conns[i].send(("stop",))
            except OSError:
                pass  # already gone
        self.children.stop(timeout=15.0)
        for conn in self.conns:
            conn.close()
        self.conns = []


def _gpu_slices(config, n: int, per_replica: int) -> list[list[str] | None]:
    """The CUDA devices each replica may see (its own tp x pp of them), or None each on CPU."""
    import torch

    from engine.runner.model_runner import resolve_device

    if resolve_device(config.device).type == "cpu":
        return [None] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return [ids[i * per_replica:(i + 1) * per_replica] for i in range(n)]
