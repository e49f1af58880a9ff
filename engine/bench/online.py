"""`engine bench serve`: for each server (a URL, or each of `--launch engine,vllm,llamacpp` in turn)
and each `--max-concurrency` level, one measured run of the same requests; one table.

A launched server is started once, measured at every level, and stopped (its whole
process group) before the next one starts, so the two never share the machine.
"""

from __future__ import annotations

import os
import sys

from engine.bench import report, serve
from engine.bench.common import RESULTS_DIR, load_tokenizer, peer_threads, report_settings
from engine.bench.datasets import build_requests

# Launched servers that close a connection after each streamed response though they announce
# keep-alive (llama-server: curl -v shows "Connection died, retrying"); the client opens a new one
# per request for them, or 5-10% of requests fail on a reused connection.
NO_KEEPALIVE = ("llamacpp",)

# Engine flags a launched `engine serve` always gets, whatever their values: the bench resolves them.
ALWAYS_PASSED = ("dtype", "seed", "num_threads", "kv_cache_memory")


def engine_server_settings(args) -> dict:
    """Every engine flag of the bench that differs from EngineConfig's default, plus ALWAYS_PASSED."""
    from dataclasses import fields

    from engine.config import EngineConfig

    out = {}
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        if f.name != "model" and value is not None and (f.name in ALWAYS_PASSED or value != f.default):
            out[f.name] = value
    return out


def launch_cmd(args, which: str, requests=None) -> tuple[list[str], dict]:
    """The server command line (with "{port}") and extra environment for `which`."""
    if which == "llamacpp":  # its own flags: --server-arg holds `engine serve` / `vllm serve` ones
        from engine.bench.backends import llamacpp
        from engine.bench.launch import llamacpp_server_cmd

        return llamacpp_server_cmd(llamacpp.find_server(args.llamacpp_server), llamacpp.resolve_gguf(args),
                                   peer_threads(args), llamacpp.server_slots(args),
                                   llamacpp.slot_context(args, requests), args.served_model_name,
                                   args.llamacpp_server_arg), {}
    import torch

    from engine.bench.backends.vllm import cpu_env, vllm_engine_kwargs, warn_kv_env
    from engine.bench.launch import cli_flags, engine_server_cmd, vllm_server_cmd

    cpu = not torch.cuda.is_available()
    named = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    if which == "engine":
        return engine_server_cmd(args.model, cli_flags(engine_server_settings(args)) + named + args.server_arg), {}
    # vLLM-CPU: every core for compute, and the same explicit KV budget as ours.
    if cpu:
        warn_kv_env()
    env = {k: os.environ.get(k, v) for k, v in cpu_env(peer_threads(args)).items()} if cpu else {}
    flags = cli_flags(vllm_engine_kwargs(args, cpu)) + named + args.server_arg
    return vllm_server_cmd(args.model, flags, python=args.vllm_python), env


def result_path(args, runs: list[dict], started) -> str:
    """Where --save-result writes: vLLM's name, LABEL-RATEqps[-concurrencyN]-MODEL-DATE-TIME.json."""
    name = args.result_filename
    if not name:
        label = args.label or ("+".join(args.launch) if args.launch else
                               {"completions": "openai", "chat": "openai-chat"}[args.endpoint])
        levels = [str(n) for n in args.concurrency_levels if n is not None]
        concurrency = f"-concurrency{'_'.join(levels)}" if levels else ""
        model = args.served_model_name or next((r.get("served_model_name") for r in runs), None) or args.model
        model_id = str(model).rstrip("/").split("/")[-1]
        name = f"{label}-{args.request_rate}qps{concurrency}-{model_id}-{started:%Y%m%d-%H%M%S}.json"
    return os.path.join(args.result_dir or RESULTS_DIR, name)


def load_label(args, level: int | None) -> str:
    rate = f"request rate {args.request_rate:g}/s"
    if args.request_rate != float("inf"):
        rate += f" (burstiness {args.burstiness:g})"
    return rate + (f", max concurrency {level}" if level else "")


def measure_levels(args, requests, tokenizer, base_url: str, server: str, levels) -> list[dict]:
    runs = []
    for level in levels:
        print(f"\n--- {server}: {load_label(args, level)} ---", flush=True)
        result = serve.run(args, requests, tokenizer, base_url, max_concurrency=level,
                           keepalive=server not in NO_KEEPALIVE)
        m = result["metrics"]
        print(f"{' Serving Benchmark Result ':=^50}\n{server}, {load_label(args, level)}\n"
              + report.serve_summary(m, args.percentiles) + "\n" + "=" * 50, flush=True)
        if result["errors"]:
            print("first errors:\n  " + "\n  ".join(e[:300] for e in result["errors"][:5]), file=sys.stderr)
        runs.append({"server": server, "max_concurrency": level, "request_rate": args.request_rate, **result})
    return runs


def run_serve(args) -> int:
    from datetime import datetime

    from engine.bench.launch import ServerProcess

    started = datetime.now()
    levels = args.concurrency_levels
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    requests = build_requests(args, tokenizer)
    runs: list[dict] = []
    servers: dict[str, dict] = {}
    for which in args.launch or []:
        cmd, env = launch_cmd(args, which, requests)
        log = None
        if args.server_log:
            log = args.server_log.replace("{server}", which)
            if log == args.server_log and len(args.launch) > 1:
                root, ext = os.path.splitext(log)
                log = f"{root}-{which}{ext}"
        server = ServerProcess(cmd, env=env, startup_timeout=args.launch_timeout, log_path=log, name=f"{which}-server")
        print(f"launching {which}: {' '.join(server.cmd)}" + (f"  (env {env})" if env else "")
              + f"\n  log: {server.log_path}", flush=True)
        with server:
            print(f"{which} healthy at {server.base_url} after {server.startup_s:.1f}s (start-up, not measured)",
                  flush=True)
            servers[which] = {"cmd": server.cmd, "env": env, "startup_s": server.startup_s, "log": server.log_path}
            runs += measure_levels(args, requests, tokenizer, server.base_url, which, levels)
    if args.base_url:
        servers[args.base_url] = {}
        runs += measure_levels(args, requests, tokenizer, args.base_url, args.base_url, levels)

    print("\n" + summary_table(runs, servers, args.percentiles))
    print(f"\nmodel {args.model}, dtype {args.dtype}, {len(requests)} requests per run, endpoint {args.endpoint}, "
          f"prompts as {'text' if args.endpoint == 'chat' else args.prompt_format}, ignore_eos {args.ignore_eos}")
    out = {"mode": "serve", "settings": report_settings(args), "environment": report.environment(),
           "servers": servers, "runs": runs}
    if args.output_json:
        report.write_json(args.output_json, out)
    if args.save_result:
        report.write_json(result_path(args, runs, started), out)
    if args.plot:
        from engine.bench import plot

        plot.plot_serve({run_label(r): r["samples"] for r in runs}, args.plot)
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1


def run_label(run: dict) -> str:
    return run["server"] + (f" c={run['max_concurrency']}" if run["max_concurrency"] else "")


def summary_table(runs: list[dict], servers: dict, percentiles: list[float]) -> str:
    q = f"p{max(percentiles):g}_ms"
    rows = []
    for r in runs:
        m = r["metrics"]
        rows.append([
            r["server"], r["max_concurrency"] or "-", f"{r['request_rate']:g}", m["completed"], m["failed"],
            m["request_throughput"], m["output_throughput"], m["total_token_throughput"],
            m["ttft"]["mean_ms"], m["ttft"]["median_ms"], m["ttft"][q], m["tpot"]["mean_ms"], m["tpot"][q],
            m["itl"]["mean_ms"], m["e2el"]["mean_ms"], m["e2el"][q],
            m.get("request_goodput"), (servers.get(r["server"]) or {}).get("startup_s"),
        ])
    p = q[:-3]
    return report.table(
        ["server", "concurrency", "rate", "ok", "failed", "req/s", "out tok/s", "total tok/s",
         "TTFT mean ms", "TTFT median ms", f"TTFT {p} ms", "TPOT mean ms", f"TPOT {p} ms", "ITL mean ms",
         "E2EL mean ms", f"E2EL {p} ms", "goodput req/s", "start-up s"],
        rows,
    )
