"""Benchmarks: pagewise against vLLM and Hugging Face transformers.

    cli.py        `engine bench throughput | latency | serve` (argument parsing only)
    runner.py     checks and resolves settings, draws requests, runs a mode, reports
    checks.py     optional packages and the vLLM interpreter, checked before any work
    datasets.py   random token-id prompts and ShareGPT files -> SampleRequest
    offline.py    one backend in this process: start-up apart, then the measured window
    compare.py    `--compare`: each backend in its own process on identical requests
    backends/     engine (ours), hf (transformers), vllm, openai_http (streamed client)
    serve.py      online load: Poisson arrivals, concurrency cap, streamed requests
    metrics.py    vLLM's metric definitions (TTFT, TPOT, ITL, E2EL, goodput)
    launch.py     start / health-check / stop a server process group
    report.py     tables and the JSON report;  plot.py  the --plot charts
"""
