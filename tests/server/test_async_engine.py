"""AsyncEngine unit tests: abort, admission control, rejected prompts, shutdown (with a small fake
of the EngineCore contract), and loop death (with the real tiny model, its step made to fail)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.frontend.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, EngineShuttingDownError
from engine.loading.sampling_defaults import SamplingDefaults
from engine.outputs import CoreOutput, RequestOutput
from engine.sampling_params import SamplingParams


class NumberTokenizer:
    """Token i reads as " i"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)


class FakeCore:
    """The core's contract (CoreClient) in miniature: FIFO waiting queue, max_num_seqs running, one
    token per running request per step (token id = step count), one CoreOutput per token. While
    `hold` is clear, steps make no progress, so tests can look at a full queue."""

    model_name = "fake"
    max_model_len = 64
    sampling_defaults = SamplingDefaults()
    tokenizer = NumberTokenizer()

    def __init__(self, config: EngineConfig):
        self.config = config
        self.hold = threading.Event()
        self.hold.set()
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.reqs: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self._abort_outputs: list[CoreOutput] = []
        self.thread_ids: set[int] = set()
        self.checks: list[str] = []  # the prompts check_request saw, one entry a call

    def _touch(self):
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt_token_ids, sampling_params, arrival_time=None, lora_request=None):
        self._touch()  # the front end checked it (check_request) before handing it over
        self.reqs[request_id] = (list(prompt_token_ids), sampling_params, [])
        self.waiting.append(request_id)

    def abort_request(self, request_ids):
        self._touch()
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self.reqs:
                self.aborted.append(rid)
                self._abort_outputs.append(CoreOutput(rid, 0, finish_reason="abort", request_finished=True))
                self._drop(rid)

    def _drop(self, rid):
        self.reqs.pop(rid)
        for q in (self.waiting, self.running):
            if rid in q:
                q.remove(rid)

    def check_request(self, ids, params, lora_request=None):
        self.checks.append(str(ids))
        if not ids:
            raise ValueError("prompt is empty: give at least one token")

    def finish_choice(self, request_id, index, stop):
        pass  # no stop strings in these tests

    def check_health(self):
        pass  # no worker processes to lose

    def shutdown(self):
        pass

    def has_unfinished_requests(self):
        return bool(self.reqs) or bool(self._abort_outputs)

    def step(self):
        self._touch()
        outputs, self._abort_outputs = self._abort_outputs, []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        time.sleep(0.002)  # a step takes time, as a real one does
        if not self.hold.is_set():
            return outputs
        for rid in list(self.running):
            ids, params, out = self.reqs[rid]
            out.append(len(out) + 1)
            reason = "length" if len(out) >= params.max_tokens else None
            outputs.append(CoreOutput(rid, 0, [out[-1]], finish_reason=reason, request_finished=reason is not None))
            if reason:
                self._drop(rid)
        return outputs

    def stats(self):
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_cache_usage": len(self.reqs) / 100, "num_used_blocks": len(self.reqs), "num_total_blocks": 100,
                "prefix_cache_hit_rate": 0.0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                "num_preemptions": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0}


def _engine(**config) -> tuple[AsyncEngine, list[FakeCore]]:
    cores = []

    def factory(cfg):
        cores.append(FakeCore(cfg))
        return cores[-1]

    return AsyncEngine(EngineConfig(**config), core_factory=factory), cores


async def _collect(stream) -> RequestOutput:
    """The deltas of a stream, merged into one output."""
    whole = None
    async for out in stream:
        whole = out if whole is None else whole.merge(out)
    return whole


def test_streams_deltas_and_core_stays_on_one_thread():
    async def main():
        engine, cores = _engine()
        await engine.start()
        finals = await asyncio.gather(*(_collect(engine.generate(f"r{i}", [1, 2], SamplingParams(max_tokens=5)))
                                        for i in range(8)))
        await engine.shutdown(1)
        return finals, cores[0]

    finals, core = asyncio.run(main())
    for out in finals:
        assert out.finished and out.outputs[0].token_ids == [1, 2, 3, 4, 5]
        assert out.outputs[0].finish_reason == "length"
    assert len(core.thread_ids) == 1 and threading.get_ident() not in core.thread_ids


def test_each_request_is_checked_once_and_a_whole_output_comes_once():
    """delta=False (a non-streamed response) yields one output, the whole of it, stamped with the
    times its tokens came out; either way the core's admission check runs once per request."""
    async def main():
        engine, cores = _engine()
        await engine.start()
        whole = [out async for out in engine.generate("w", [1, 2], SamplingParams(max_tokens=5), delta=False)]
        deltas = [out async for out in engine.generate("d", [3], SamplingParams(max_tokens=5))]
        await engine.shutdown(1)
        return whole, deltas, cores[0]

    whole, deltas, core = asyncio.run(main())
    assert len(whole) == 1 and whole[0].finished
    assert whole[0].outputs[0].token_ids == [1, 2, 3, 4, 5] and whole[0].outputs[0].text == " 1 2 3 4 5"
    times = whole[0].token_times
    assert sum(n for _, n in times) == 5 and all(whole[0].arrival_time <= t for t, _ in times)
    assert [t for t, _ in times] == sorted(t for t, _ in times)
    merged = deltas[0]
    for out in deltas[1:]:
        merged = merged.merge(out)
    assert merged.outputs[0].token_ids == whole[0].outputs[0].token_ids and len(merged.token_times) == 5
    assert core.checks == ["[1, 2]", "[3]"]


def test_closing_a_stream_aborts_its_request():
    async def main():
        engine, cores = _engine()
        await engine.start()
        core = cores[0]
        stream = engine.generate("a", [1], SamplingParams(max_tokens=10_000))
        first = await stream.__anext__()
        core.hold.clear()  # keep it running
        await stream.aclose()  # the client went away
        deadline = time.monotonic() + 5
        while "a" not in core.aborted:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # stats are refreshed after the abort is applied
        stats = engine.stats()
        core.hold.set()
        await engine.shutdown(1)
        return first, core, stats

    first, core, stats = asyncio.run(main())
    assert len(first.outputs[0].token_ids) >= 1
    assert core.reqs == {} and stats["num_used_blocks"] == 0 and stats["num_requests_aborted"] == 1


def test_admission_rejects_past_waiting_limit_and_admitted_complete():
    async def main():
        engine, cores = _engine(max_num_seqs=1, max_waiting_requests=1)
        await engine.start()
        cores[0].hold.clear()
        a = engine.generate("a", [1], SamplingParams(max_tokens=3))
        b = engine.generate("b", [1], SamplingParams(max_tokens=3))
        ta = asyncio.ensure_future(_collect(a))  # 1 running slot
        tb = asyncio.ensure_future(_collect(b))  # 1 waiting
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloadedError):
            await engine.generate("c", [1], SamplingParams(max_tokens=3)).__anext__()
        stats = engine.stats()
        cores[0].hold.set()
        finals = await asyncio.gather(ta, tb)
        # with room again, a new request is admitted
        late = await _collect(engine.generate("d", [1], SamplingParams(max_tokens=2)))
        await engine.shutdown(1)
        return stats, finals, late

    stats, finals, late = asyncio.run(main())
    assert stats["num_running"] == 1 and stats["num_waiting"] == 1 and stats["num_requests_rejected"] == 1
    assert [f.outputs[0].token_ids for f in finals] == [[1, 2, 3], [1, 2, 3]]
    assert late.outputs[0].token_ids == [1, 2]


def test_rejected_prompt_raises_value_error_and_duplicate_id():
    async def main():
        engine, _ = _engine()
        await engine.start()
        with pytest.raises(ValueError, match="prompt is empty"):
            await _collect(engine.generate("x", [], SamplingParams()))
        s = engine.generate("dup", [1], SamplingParams(max_tokens=50))
        await s.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await engine.generate("dup", [1], SamplingParams()).__anext__()
        await s.aclose()
        await engine.shutdown(1)

    asyncio.run(main())


def test_shutdown_finishes_then_aborts_with_a_final_event():
    async def main():
        engine, cores = _engine()
        await engine.start()
        quick = asyncio.ensure_future(_collect(engine.generate("quick", [1], SamplingParams(max_tokens=2))))
        slow = engine.generate("slow", [1], SamplingParams(max_tokens=10_000))
        whole_task = asyncio.ensure_future(_collect(engine.generate("whole", [1], SamplingParams(max_tokens=10_000),
                                                                    delta=False)))
        await slow.__anext__()
        await quick
        while not cores[0].reqs.get("whole", (0, 0, []))[2]:
            await asyncio.sleep(0.01)
        cores[0].hold.clear()  # "slow" can no longer finish in time
        slow_task = asyncio.ensure_future(_collect(slow))
        t0 = time.monotonic()
        await engine.shutdown(timeout=0.3)
        took = time.monotonic() - t0
        with pytest.raises(EngineShuttingDownError):
            await engine.generate("late", [1], SamplingParams()).__anext__()
        return quick.result(), await slow_task, await whole_task, took, cores[0], engine

    quick, slow, whole, took, core, engine = asyncio.run(main())
    assert quick.outputs[0].finish_reason == "length"
    assert slow.finished and slow.outputs[0].finish_reason == "abort" and slow.outputs[0].token_ids
    # A non-streamed request ends with its whole output so far, not an empty abort.
    assert whole.finished and whole.outputs[0].finish_reason == "abort" and whole.outputs[0].token_ids
    assert whole.outputs[0].text == "".join(f" {t}" for t in whole.outputs[0].token_ids)
    assert 0.3 <= took < 5 and "slow" in core.aborted and core.reqs == {}
    assert not engine.is_healthy  # stopped


def test_loop_death_fails_pending_requests_promptly(tiny_model_dir, caplog):
    """A failing step (injected into the real core) errors every pending request at once, turns
    health off, logs the traceback, and refuses new work."""
    from engine.core.engine_core import EngineCore
    from engine.frontend.startup import build_engine_core

    class FailingCore(EngineCore):
        fail_after = 3

        def step(self):
            self.fail_after -= 1
            if self.fail_after < 0:
                raise RuntimeError("injected kernel failure")
            return super().step()

    async def main():
        engine = AsyncEngine(EngineConfig(model=tiny_model_dir, device="cpu", num_kv_blocks=256, num_threads=1),
                             core_factory=lambda config: build_engine_core(config, FailingCore))
        await engine.start()
        assert engine.is_healthy
        streams = [engine.generate(f"r{i}", [5, 6, 7, 8], SamplingParams(max_tokens=200, ignore_eos=True))
                   for i in range(4)]
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*(_collect(s) for s in streams), return_exceptions=True), 30)
        took = time.monotonic() - t0
        healthy = engine.is_healthy
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.generate("late", [1, 2], SamplingParams()).__anext__()
        await engine.shutdown(1)
        return results, took, healthy

    with caplog.at_level(logging.ERROR, logger="pagewise.async_engine"):
        results, took, healthy = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert took < 10 and not healthy
    record = next(r for r in caplog.records if "engine loop died" in r.getMessage())
    assert record.exc_info and "injected kernel failure" in str(record.exc_info[1])


def test_loop_death_over_http_gives_500_and_unhealthy(tiny_model_dir, caplog):
    """Through the app: the in-flight request gets an OpenAI-shaped 500 without internals, /health 503."""
    from fastapi.testclient import TestClient

    from engine.core.engine_core import EngineCore
    from engine.frontend.startup import build_engine_core
    from server.app import build_app

    armed = threading.Event()

    class FailingCore(EngineCore):
        def step(self):
            if armed.is_set():
                raise RuntimeError("injected kernel failure")
            return super().step()

    engine = AsyncEngine(EngineConfig(model=tiny_model_dir, device="cpu", num_kv_blocks=256, num_threads=1),
                         core_factory=lambda config: build_engine_core(config, FailingCore))
    with TestClient(build_app(engine, shutdown_timeout=1)) as http:
        ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200 and http.get("/health").status_code == 200
        armed.set()
        with caplog.at_level(logging.ERROR, logger="pagewise.async_engine"):
            r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "injected" not in err["message"] and "Traceback" not in r.text
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "unhealthy"
        assert http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}).status_code == 500
    assert any("engine loop died" in rec.getMessage() and rec.exc_info for rec in caplog.records)
