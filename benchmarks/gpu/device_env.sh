# Sourced by the scripts a GPU machine runs (from the repository root): $OUT made, the wheels
# carried in .whl/ (what the device image lacks) installed to /tmp/site, the checkout importable
# from scripts under benchmarks/, Python output unbuffered (a command cut at its limit keeps it).
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

# gpu_tests LIMIT_S PYTEST_ARGS...: the tests on 16 xdist workers within LIMIT_S, failures logged as
# they happen ($OUT/failures.txt, kept when the limit cuts pytest short), the log's tail printed.
gpu_tests() {
    local limit=$1; shift
    timeout "$limit" python3 -m pytest "$@" -n 16 -q -rfE -p no:cacheprovider -p tests.failure_log \
        --failure-log="$OUT/failures.txt" >"$OUT/tests.log" 2>&1
    echo "== tests rc=$?"
    grep -v "PytestBenchmarkWarning\|warner(" "$OUT/tests.log" | grep -v "^  \|^$" | tail -10
    grep "^-----" "$OUT/failures.txt" 2>/dev/null | head -20
}
