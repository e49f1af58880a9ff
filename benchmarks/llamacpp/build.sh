#!/usr/bin/env bash
# Build llama.cpp (llama-server, llama-bench, llama-batched-bench, llama-quantize) and the
# llama-cpp-python binding from the llama-cpp-python source package, for the
# `engine bench` peer comparisons. Neither project ships CPU binaries for this
# machine's Python/glibc, and the sdist vendors a llama.cpp tree that matches
# the binding, so both come from the same source.
#
# Usage: benchmarks/llamacpp/build.sh [DEST]
#   DEST     build directory outside the repo (default: $LLAMACPP_HOME, else
#            /opt/llamacpp when writable, else ~/.cache/pagewise/llamacpp)
# Environment:
#   LLAMACPP_SDIST   an already-downloaded llama_cpp_python-*.tar.gz
#   LLAMACPP_VERSION the version pip downloads when no sdist is given
#   JOBS             parallel build jobs (default 1: shared machines)
#   SKIP_PYTHON=1    build only the binaries
#
# Idempotent: a finished step is skipped on the next run; delete DEST to
# start over. Binaries end up in DEST/bin.
set -euo pipefail

default_dest() {
    if [[ -n "${LLAMACPP_HOME:-}" ]]; then
        echo "$LLAMACPP_HOME"
    elif mkdir -p /opt/llamacpp 2>/dev/null && [[ -w /opt/llamacpp ]]; then
        echo /opt/llamacpp
    else
        echo "$HOME/.cache/pagewise/llamacpp"
    fi
}

DEST="$(realpath -m "${1:-$(default_dest)}")"
JOBS="${JOBS:-1}"
NICE=(nice -n 19)
# -march=native, less AMX: ggml's AMX matmul (ggml_backend_amx_mul_mat) segfaults at the first
# prompt on this machine's Sapphire-Rapids-class CPU (llama.cpp issue 20824, open upstream), while
# AMX itself works here. ggml compiles its AMX code only where the compiler defines these macros.
NO_AMX="-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
CONFIG="GGML_NATIVE=ON $NO_AMX"
mkdir -p "$DEST/bin" "$DEST/sdist"

# 1. The source package.
SDIST="${LLAMACPP_SDIST:-}"
if [[ -z "$SDIST" ]]; then
    SDIST="$(ls -1 "$DEST"/sdist/llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -n1 || true)"
fi
if [[ -z "$SDIST" ]]; then
    spec="llama-cpp-python${LLAMACPP_VERSION:+==$LLAMACPP_VERSION}"
    echo "[build.sh] downloading the $spec source package"
    pip download --no-binary :all: --no-deps "$spec" -d "$DEST/sdist"
    SDIST="$(ls -1 "$DEST"/sdist/llama_cpp_python-*.tar.gz | sort -V | tail -n1)"
fi
SDIST="$(realpath "$SDIST")"
NAME="$(basename "$SDIST" .tar.gz)"
[[ -f "$DEST/sdist/$NAME.tar.gz" ]] || cp "$SDIST" "$DEST/sdist/"
SRC="$DEST/src/$NAME"
echo "[build.sh] source package: $SDIST"

# 2. Unpack (once).
if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    mkdir -p "$DEST/src"
    tar -xzf "$SDIST" -C "$DEST/src"
fi

# 3. The binaries (again when the source or the flags changed: DEST/bin/.config records them).
BUILD="$DEST/build/$NAME"
TARGETS=(llama-server llama-bench llama-batched-bench llama-quantize)
need_build=0
for t in "${TARGETS[@]}"; do
    [[ -x "$DEST/bin/$t" ]] || need_build=1
done
[[ "$(cat "$DEST/bin/.config" 2>/dev/null)" == "$NAME $CONFIG" ]] || need_build=1
if [[ $need_build == 1 ]]; then
    start=$(date +%s)
    generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    "${NICE[@]}" cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" "${generator[@]}" \
        -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON \
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=ON \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON
    "${NICE[@]}" cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}"
    for t in "${TARGETS[@]}"; do
        install -m 0755 "$BUILD/bin/$t" "$DEST/bin/$t"
    done
    echo "$NAME $CONFIG" > "$DEST/bin/.config"
    echo "[build.sh] binaries built in $(( $(date +%s) - start )) s"
fi
echo "[build.sh] binaries: $DEST/bin/{$(IFS=,; echo "${TARGETS[*]}")}"

# 4. The Python binding, from the same source package (again when DEST/python.config differs).
if [[ "${SKIP_PYTHON:-0}" != 1 ]]; then
    want="${NAME#llama_cpp_python-}"
    have="$(python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)"
    if [[ "$have" != "$want" || "$(cat "$DEST/python.config" 2>/dev/null)" != "$NAME $CONFIG" ]]; then
        start=$(date +%s)
        # LLAVA_BUILD=OFF: the multimodal library is not needed for text decode
        # and would double the build time. CFLAGS/CXXFLAGS seed CMake's flags (no spaces
        # allowed in CMAKE_ARGS items).
        CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" \
        CFLAGS="$NO_AMX ${CFLAGS:-}" CXXFLAGS="$NO_AMX ${CXXFLAGS:-}" \
        CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" MAKEFLAGS="-j$JOBS" \
            "${NICE[@]}" pip install --no-deps --force-reinstall --no-cache-dir "$SDIST"
        # Its runtime dependencies; ones already installed are left as they are.
        pip install numpy typing-extensions diskcache jinja2
        echo "$NAME $CONFIG" > "$DEST/python.config"
        echo "[build.sh] llama-cpp-python built in $(( $(date +%s) - start )) s"
    fi
    python -c 'import llama_cpp; print("[build.sh] llama_cpp", llama_cpp.__version__, "at", llama_cpp.__file__)'
fi
