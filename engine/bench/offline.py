"""Run one offline backend in this process: `throughput` or `latency` over given requests.

Start-up (model load, compile, KV cache, one short warm-up generate) is timed apart and
stays outside the measured window. Returns a plain dict for the report / the parent.
"""

from __future__ import annotations

import sys
import time

from engine.bench.backends import get_backend
from engine.bench.common import peer_threads
from engine.bench.datasets import SampleRequest
from engine.bench.metrics import distribution, throughput_metrics


def set_threads(args) -> int | str:
    """Pin a peer's threads (or the engine's, given --num-threads); the engine's default follows the load."""
    import torch

    if args.backend == "engine" and args.num_threads is None:
        return "auto"  # the engine default: the usable CPUs, fewer under load
    torch.set_num_threads(peer_threads(args))
    return torch.get_num_threads()


def start_backend(args, requests: list[SampleRequest]):
    """Build, load and warm up the backend; returns (backend, facts about the start-up)."""
    threads = set_threads(args)
    backend = get_backend(args.backend)(args)
    t0 = time.perf_counter()
    backend.load()
    t1 = time.perf_counter()
    limit = getattr(backend, "max_model_len", None)
    over = [r for r in requests if limit is not None and len(r.prompt_token_ids) + r.output_len > limit]
    if over:  # the engine would cut their outputs short, and TPOT would be made of the wrong tokens
        r = over[0]
        raise ValueError(f"--input-len / --output-len: {len(r.prompt_token_ids)} prompt + {r.output_len} output "
                         f"tokens do not fit the engine's max_model_len ({limit}): lower them, or raise "
                         "--max-model-len")
    first = requests[0]
    warm = SampleRequest(prompt_token_ids=first.prompt_token_ids[:16], output_len=4)
    backend.generate([warm], use_tqdm=False)
    t2 = time.perf_counter()
    facts = {"backend": args.backend, "threads": threads, "load_s": t1 - t0, "warmup_s": t2 - t1,
             "startup_s": t2 - t0, "python": sys.executable}
    return backend, facts


def count_check(requests: list[SampleRequest], generated: list[list[int]]) -> tuple[bool, list[dict]]:
    """Did every request get exactly the tokens it asked for? (EOS is ignored everywhere.)"""
    bad = [{"index": i, "asked": r.output_len, "got": len(g)}
           for i, (r, g) in enumerate(zip(requests, generated)) if len(g) != r.output_len]
    return not bad and len(generated) == len(requests), bad[:10]


def run_throughput(args, requests: list[SampleRequest]) -> dict:
    backend, out = start_backend(args, requests)
    t0 = time.perf_counter()
    generated = backend.generate(requests, use_tqdm=not args.disable_tqdm)
    wall = time.perf_counter() - t0
    ok, bad = count_check(requests, generated)
    out.update(
        metrics=throughput_metrics([r.prompt_len for r in requests], [len(g) for g in generated], wall),
        expected_output_tokens=sum(r.output_len for r in requests),
        token_count_ok=ok, token_count_mismatches=bad, info=backend.info(),
    )
    if not ok:
        print(f"WARNING [{args.backend}]: output token counts differ from what was asked: {bad}", file=sys.stderr)
    return out


def latency_batches(requests: list[SampleRequest], batch_size: int) -> list[list[SampleRequest]]:
    return [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]


def run_latency(args, requests: list[SampleRequest]) -> dict:
    """Each iteration: a fresh batch with max_tokens=1 (TTFT), then a fresh full batch (E2E).

    Fresh random prompts every time, so no prefix cache can serve a repeat. TPOT for an
    iteration is (E2E - TTFT) / (output_len - 1).
    """
    from tqdm import tqdm

    backend, out = start_backend(args, requests)
    batches = latency_batches(requests, args.batch_size)
    n_warm, n_iter = args.num_iters_warmup, args.num_iters
    assert len(batches) == 2 * (n_warm + n_iter), "the parent draws two batches per iteration"
    ttfts, e2es, tpots, counts_ok = [], [], [], True
    bar = tqdm(total=n_warm + n_iter, desc=f"{args.backend} latency", disable=args.disable_tqdm)
    for it in range(n_warm + n_iter):
        prefill = [SampleRequest(r.prompt_token_ids, 1) for r in batches[2 * it]]
        full = batches[2 * it + 1]
        t0 = time.perf_counter()
        backend.generate(prefill, use_tqdm=False)
        t1 = time.perf_counter()
        generated = backend.generate(full, use_tqdm=False)
        t2 = time.perf_counter()
        counts_ok &= count_check(full, generated)[0]
        if it >= n_warm:
            ttft, e2e = t1 - t0, t2 - t1
            ttfts.append(ttft)
            e2es.append(e2e)
            tpots.append((e2e - ttft) / (args.output_len - 1) if args.output_len > 1 else 0.0)
        bar.update(1)
    bar.close()
    pct = args.percentiles
    out.update(
        # Only the measured iterations count: warm-up batches and the prefill-only TTFT batches do not.
        batch_size=args.batch_size, num_iters=len(e2es), num_iters_warmup=n_warm,
        num_requests=len(e2es) * args.batch_size,
        latencies_s=e2es, ttfts_s=ttfts, e2e=distribution(e2es, pct), ttft=distribution(ttfts, pct),
        tpot=distribution(tpots, pct), token_count_ok=counts_ok, info=backend.info(),
    )
    return out
