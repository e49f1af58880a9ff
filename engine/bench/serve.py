"""`engine bench serve`: online load against an OpenAI-compatible server, vLLM's way.

Requests leave on a Poisson schedule (`--request-rate`, gamma-distributed gaps with
`--burstiness`; `inf` sends all at once), optionally capped by `--max-concurrency`.
Every request streams; metrics.serve_metrics turns the timings into the report. One
warm-up request (not measured) first checks that the server answers at all.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from engine.bench.backends.openai_http import auth_headers, build_payload, stream_request
from engine.bench.datasets import SampleRequest
from engine.bench.metrics import RequestResult, serve_metrics


def base_urls(base_url: str) -> tuple[str, str]:
    """'http://h:p' or 'http://h:p/v1' -> (root for /health, API base ending in /v1)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root, root + "/v1"


async def served_model_name(client, api: str, headers: dict) -> str | None:
    try:
        r = await client.get(api + "/models", headers=headers)
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except Exception:
        return None


async def arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield 0..n-1 with gamma-distributed gaps of mean 1/rate (Poisson at burstiness 1)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


def prompt_for(req: SampleRequest, fmt: str, endpoint: str, tokenizer):
    if fmt == "tokens" and endpoint == "completions":
        return req.prompt_token_ids
    return req.prompt if req.prompt is not None else tokenizer.decode(req.prompt_token_ids)


async def run_load(args, requests: list[SampleRequest], tokenizer, api: str, model: str,
                   max_concurrency: int | None, keepalive: bool = True) -> dict:
    import httpx
    from tqdm import tqdm

    from engine.bench.load_progress import LoadProgress

    url = api + ("/chat/completions" if args.endpoint == "chat" else "/completions")
    headers = auth_headers(args.api_key)
    # keepalive=False: a fresh connection per request, for servers that close a connection after a
    # streamed response while announcing keep-alive (llama-server), which fails the next request on it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None if keepalive else 0)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    extra = dict(args.extra_body or {})

    def payload(req: SampleRequest, output_len: int | None = None) -> dict:
        return build_payload(args.endpoint, model, prompt_for(req, args.prompt_format, args.endpoint, tokenizer),
                             output_len or req.output_len, args.ignore_eos, extra)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        for i in range(args.num_warmups):
            w = await stream_request(client, url, payload(requests[i % len(requests)], 4), headers,
                                     args.endpoint, requests[0].prompt_len, tokenizer)
            if not w.success:  # the server or the arguments: the user's to fix (one line, exit 2)
                raise ValueError(f"{url}: the warm-up request failed ({w.error}): check that the server runs "
                                 "there (--base-url) and takes these arguments")

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        progress = LoadProgress(tqdm(total=len(requests), desc="bench serve", disable=args.disable_tqdm))
        t0 = time.perf_counter()

        async def one(req: SampleRequest) -> RequestResult:
            async def go():
                progress.on_sent()
                return await stream_request(client, url, payload(req), headers, args.endpoint,
                                            req.prompt_len, tokenizer, t0, on_token=progress.on_token)
            if sem is None:
                r = await go()
            else:
                async with sem:
                    r = await go()
            progress.on_finished(r.success)
            return r

        with progress:
            tasks = []
            async for i in arrivals(len(requests), args.request_rate, args.burstiness, args.seed):
                tasks.append(asyncio.create_task(one(requests[i])))
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
    metrics = serve_metrics(results, duration, args.percentiles, args.goodput_slos)
    errors = [r.error for r in results if not r.success]
    return {
        "metrics": metrics,
        "errors": errors[:20],
        "samples": {  # per-request values (seconds), for CDF plots and re-analysis
            "ttft": [r.ttft for r in results if r.success],
            "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1)
                     for r in results if r.success and r.output_tokens > 1],
            "itl": [x for r in results if r.success for x in r.itl],
            "e2el": [r.latency for r in results if r.success],
            "output_tokens": [r.output_tokens for r in results if r.success],
        },
    }


async def resolve_model_name(args, api: str) -> str:
    import httpx

    if args.served_model_name:
        return args.served_model_name
    async with httpx.AsyncClient(timeout=30.0) as client:
        name = await served_model_name(client, api, auth_headers(args.api_key))
    return name or args.model or "default"


def run(args, requests: list[SampleRequest], tokenizer, base_url: str, max_concurrency: int | None = None,
        keepalive: bool = True) -> dict:
    """One measured run at one load level against `base_url`."""
    _, api = base_urls(base_url)

    async def main():
        model = await resolve_model_name(args, api)
        out = await run_load(args, requests, tokenizer, api, model, max_concurrency, keepalive)
        out["served_model_name"] = model
        return out

    return asyncio.run(main())
