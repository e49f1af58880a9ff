"""One data-parallel replica: a whole EngineCore (itself maybe TP x PP) in its own process,
stepped by commands from the front (engine.frontend.data_parallel) over a pipe.

Front -> replica: ("add", request_id, prompt_token_ids, sampling_params, arrival_time, lora_request),
("abort", [request_ids]), ("finish", request_id, index, stop_string), ("stop",). Replica ->
front: ("ready", max_model_len, stats) once, then ("step", core_outputs, stats) after every step,
("rejected", request_id, message) for a request its core refused, and ("error", message) just
before it dies of a failed step. Core outputs are token deltas: text is made in the front.
"""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)


def replica_main(index: int, config, fd: int, gpus: list[str] | None) -> None:
    if gpus is not None:  # before anything touches CUDA: this replica sees only its own GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    from engine.frontend.startup import build_engine_core

    conn = Connection(fd)
    core = build_engine_core(config)
    try:
        conn.send(("ready", core.max_model_len, core.stats()))
        logger.info("engine core process ready" if config.core_process else f"data-parallel replica {index} ready")
        serve(core, conn)
    finally:
        core.shutdown()


def serve(core, conn: Connection) -> None:
    while True:
        if not core.has_unfinished_requests():
            conn.poll(None)  # idle: sleep until the front sends something
        while conn.poll():
            msg = conn.recv()
            if msg[0] == "stop":
                return
            if msg[0] == "abort":
                core.abort_request(msg[1])
                continue
            if msg[0] == "finish":  # the front found a stop string
                core.finish_choice(*msg[1:])
                continue
            _, request_id, ids, params, arrival_time, lora_request = msg
            try:
                core.add_request(request_id, ids, params, arrival_time=arrival_time, lora_request=lora_request)
            except Exception as e:  # the front validated the prompt: this is unexpected, but only this request's
                logger.exception("add_request failed for request %s", request_id)
                conn.send(("rejected", request_id, f"{type(e).__name__}: {e}"))
        if core.has_unfinished_requests():
            try:
                outputs = core.step()
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
                raise
            conn.send(("step", outputs, core.stats()))
