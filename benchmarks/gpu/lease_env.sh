# Sourced by the scripts a device lease runs (from the repository root): $OUT made, the wheels
# carried in .whl/ (what the device image lacks) installed to /tmp/site, the checkout importable
# from scripts under benchmarks/, Python output unbuffered (a command cut at its limit keeps it).
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
