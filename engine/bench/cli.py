"""`engine bench throughput | latency | serve` (also `python -m engine.bench.cli ...`).

    engine bench throughput --compare engine,vllm,hf --num-prompts 64 --input-len 128 --output-len 128
    engine bench latency --batch-size 8 --input-len 32 --output-len 128 --num-iters 10
    engine bench serve --launch engine,vllm --max-concurrency 1,8,32 --num-prompts 64

`add_parser(subparsers)` registers `bench` on the engine CLI; `main(argv)` runs alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from engine.bench.backends import BACKENDS


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _percentiles(text: str) -> list[float]:
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"percentiles are numbers separated by commas, got {text!r}") from None
    if not ps or not all(0 < p < 100 for p in ps):
        raise argparse.ArgumentTypeError(f"percentiles must lie in (0, 100), got {text!r}")
    return ps


def _servers(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or any(n not in ("engine", "vllm") for n in names):
        raise argparse.ArgumentTypeError(f"--launch takes engine, vllm or engine,vllm; got {text!r}")
    return names


def _levels(text: str | None) -> list[int | None]:
    if not text:
        return [None]
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-concurrency takes integers like 8 or 1,8,32; got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--max-concurrency levels must be >= 1; got {text!r}")
    return levels


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and threads")
    g.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = bfloat16 on CUDA, float32 on CPU; resolved once, the same for every backend")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", type=int, default=_cores(),
                   help="torch compute threads, pinned with torch.set_num_threads (default: all cores, %(default)s)")
    g.add_argument("--output-json", default=None, help="write all settings and results here")
    g.add_argument("--plot", default=None, help="write a PNG chart here (matplotlib)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    g.add_argument("--percentiles", type=str, default="50,90,99", help="latency percentiles (default %(default)s)")
    g.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="CPU only: the same KV cache budget for engine and vLLM (default %(default)s GiB, "
                        "the engine's own default); on CUDA each sizes its cache from free GPU memory")


def _dataset(p: argparse.ArgumentParser, num_prompts: int, input_len: int, output_len: int) -> None:
    g = p.add_argument_group("dataset: random token ids (default) or a ShareGPT JSON file")
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON; omit for random token ids")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--input-len", type=int, default=input_len, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=output_len, help="random: output tokens")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)] (default 0: all equal)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="ShareGPT: fixed output length instead of the gpt turn's length")


def _offline(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backends")
    g.add_argument("--backend", default="engine", choices=BACKENDS)
    g.add_argument("--compare", default=None, metavar="B1,B2,...",
                   help="run these backends one after the other, each in its own process, and compare")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-num-seqs", type=int, default=256, help="engine and vLLM (default %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="engine and vLLM (default %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None, help="engine and vLLM (default: the model's)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other EngineConfig field for the engine backend (repeatable)")
    g.add_argument("--hf-batch-size", type=int, default=64, help="transformers generate batch size")
    g.add_argument("--vllm-python", default=None,
                   help="interpreter with vLLM installed (e.g. /work/venv-vllm/bin/python); the vllm backend runs there")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other vllm.LLM keyword (repeatable)")
    g.add_argument("--requests-file", default=None, help=argparse.SUPPRESS)  # set by the --compare parent
    g.add_argument("--result-json", default=None, help=argparse.SUPPRESS)


def add_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmark pagewise against vLLM and transformers",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = bench.add_subparsers(dest="bench_mode", required=True, metavar="{throughput,latency,serve}")

    t = modes.add_parser("throughput", help="offline throughput over a dataset")
    _common(t)
    _dataset(t, num_prompts=64, input_len=128, output_len=128)
    _offline(t)

    lat = modes.add_parser("latency", help="latency of one batch, repeated")
    _common(lat)
    _offline(lat)
    g = lat.add_argument_group("batch")
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--input-len", type=int, default=32)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--num-iters", type=int, default=10)
    g.add_argument("--num-iters-warmup", type=int, default=2)

    s = modes.add_parser("serve", help="online load against an OpenAI-compatible server")
    _common(s)
    _dataset(s, num_prompts=100, input_len=128, output_len=128)
    g = s.add_argument_group("server")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (ours or `vllm serve`)")
    where.add_argument("--launch", type=_servers, default=None, metavar="engine|vllm|engine,vllm",
                       help="start this server (or each in turn) on 127.0.0.1, a free port, and stop it afterwards")
    g.add_argument("--served-model-name", default=None, help="model name in requests (default: GET /v1/models)")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the launched server, e.g. --server-arg=--max-num-seqs=64 (repeatable)")
    g.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for /health")
    g.add_argument("--server-log", default=None, help="launched server's log file; {server} becomes engine / vllm (default: a temp file)")
    g.add_argument("--vllm-python", default=None, help="interpreter with vLLM installed, for --launch vllm")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g = s.add_argument_group("load")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens",
                   help="completions: send token ids (exact lengths, default) or decoded text")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default inf)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    g.add_argument("--max-concurrency", type=str, default=None, metavar="N[,N...]",
                   help="at most N requests in flight; a list (1,8,32) runs each level in turn, one table")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore_eos=true, exact output lengths)")
    g.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests sent first")
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")

    for sp, mode in ((t, "throughput"), (lat, "latency"), (s, "serve")):
        sp.set_defaults(func=run_mode, bench_mode=mode, _parser=sp)
    return bench


def parse_kv(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


def run_mode(args: argparse.Namespace) -> int:
    from engine.bench import runner

    return runner.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.cli")
    sub = parser.add_subparsers(dest="command")
    bench = add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = bench.parse_args(argv[1:] if argv and argv[0] == "bench" else argv)
    # SIGTERM unwinds like Ctrl-C, so launched servers and children are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
