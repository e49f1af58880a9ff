"""Shared pytest fixtures. The tiny model is built once per test run (a few seconds)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

# Tests import `tests.tiny_model` and the packages from the repo root, installed or not.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _share_one_ssl_context(transports: str) -> None:
    """Every httpx client (the openai client's, on httpx2, too) builds an SSL context, loading the CA
    bundle: tens of milliseconds each, thousands of times a run, for servers the tests reach over
    plain http. One context per set of arguments serves them all (a context is safe to share)."""
    try:
        default = importlib.import_module(transports)
    except ImportError:  # a bare GPU image runs tests/gpu and tests/kernels without the clients
        return
    real = default.create_ssl_context
    if getattr(real, "shared", False):
        return
    contexts: dict = {}

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if not isinstance(verify, bool) or cert is not None:
            return real(verify=verify, cert=cert, trust_env=trust_env)
        if (verify, trust_env) not in contexts:
            contexts[verify, trust_env] = real(verify=verify, cert=cert, trust_env=trust_env)
        return contexts[verify, trust_env]

    create_ssl_context.shared = True
    default.create_ssl_context = create_ssl_context


for _transports in ("httpx._transports.default", "httpx2._transports.default"):
    _share_one_ssl_context(_transports)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama (2 layers, hidden 64, vocab 512) with a real tokenizer and chat template."""
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# ---------------------------------------------------------------- every engine names its device

_GPU_TESTS = os.path.join(ROOT, "tests", "gpu")
_current_test: list = [None]  # the item whose setup, call or teardown is running


def pytest_configure(config):
    config.addinivalue_line("markers", "device_auto: the test leaves EngineConfig.device 'auto' on purpose, to "
                                       "run on CUDA where there is a GPU (tests/gpu/ need no marker)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # After collection, so tests/kernels/conftest.py has set TRITON_INTERPRET before kernels import.
    _current_test[0] = item
    _guard_device_auto()


def _guard_device_auto() -> None:
    """Make an engine built with device "auto" fail its test, on every machine: on a GPU machine
    "auto" is CUDA (bfloat16, the Triton kernels), which would change what a test written for the
    CPU checks (float32 tokens, the cpu backend, thread counts, KV sizes) without CPU CI noticing.
    tests/gpu/ and tests marked device_auto mean "auto". Engines in child processes (servers,
    parallel ranks) are not seen here: tests/server/server_harness.py and
    tests/parallel/helpers.py pin those."""
    from engine.runner import model_runner

    real = model_runner.resolve_device
    if getattr(real, "guards_device_auto", False):
        return

    def resolve_device(name: str):
        item = _current_test[0]
        if (name == "auto" and item is not None and item.get_closest_marker("device_auto") is None
                and not str(item.path).startswith(_GPU_TESTS + os.sep)):
            raise AssertionError(f"{item.nodeid} builds an engine with device 'auto', which is CUDA on a GPU "
                                 "machine: pass device=\"cpu\" (--device cpu to the CLI or a server), or mark the "
                                 "test @pytest.mark.device_auto if it means to run on the GPU there")
        return real(name)

    resolve_device.guards_device_auto = True
    model_runner.resolve_device = resolve_device


# ---------------------------------------------------------------- serial tests run alone under -n 2

_serial_lock_files: list = []  # this worker's (turnstile, run) lock files, opened once


def _serial_locks(config):
    """Two files every xdist worker of this run locks: a test holds `run` shared, a serial test
    holds it exclusively; the turnstile stops new tests from starting while a serial one waits."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # not under xdist: nothing runs beside the test
        return None
    if not _serial_lock_files:
        import tempfile

        base = os.path.join(tempfile.gettempdir(), f"pagewise-serial-{workerinput['testrunuid']}")
        _serial_lock_files.extend(open(f"{base}.{name}", "a+") for name in ("turnstile", "run"))
    return _serial_lock_files


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked serial times itself against an idle CPU: under -n 2 it waits for the other
    worker's test to end, and the other worker waits for it (fixtures' setup and teardown included)."""
    locks = _serial_locks(item.config)
    if locks is None:
        yield
        return
    import fcntl

    turnstile, run = locks
    serial = item.get_closest_marker("serial") is not None
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    fcntl.flock(run, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
    if not serial:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(run, fcntl.LOCK_UN)
        if serial:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
