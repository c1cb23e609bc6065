#!/usr/bin/env bash
# Issue 36's checks on a rented GPU host (one H200, 16 cores, Python 3.12, torch with CUDA), in
# at most ~7.5 minutes of wall time. Run from the repository root with the wheels of what the host
# lacks (pyzmq, pyorc, msgspec, cryptography, cffi, pycparser) in .whl/ and $OUT set:
#
#     OUT=/some/dir bash benchmarks/gpu_host.sh
#
# Steps, each under `timeout` (a hung step cannot eat the others' time; a step gets what is left
# of the budget less what the later steps need), each writing its own file under $OUT:
#   setup.log       wheels installed into /tmp/site, versions, nvidia-smi, the table's generation
#   cuda_tests.log  pytest tests/test_pinning.py tests/test_cuda_soak.py -k cuda (the soak: SOAK_ROWS rows)
#   gpu_feed.log    benchmarks.gpu_feed, 12 workers, 800k rows: progress and per-mode lines
#   transport.log   benchmarks.gpu_feed --modes tcp,sealed (--auth): sealed vs plain TCP, 12 workers
#   scaling.log     benchmarks.scaling, 1,2,4,8,12 workers
#   results.md      the tables the three benchmarks print (their stdout), one section each
# Every benchmark stops the processes it starts by pid (and its modes are watched: a hung mode is
# reported as hung and the run goes on).
set -u
: "${OUT:?set OUT to the directory the results go to}"
mkdir -p "$OUT"
BUDGET=${BUDGET:-450}          # seconds, all steps together
ROWS=${ROWS:-800000}
DEVICE=${DEVICE:-cuda}         # DEVICE=cpu (with a small ROWS and BUDGET) only to try the script without a GPU
WORKERS=${WORKERS:-12}
TABLE=${TABLE:-/tmp/rl36/table}
START=$SECONDS
SETUP=$OUT/setup.log
RESULTS=$OUT/results.md

# cap CAP RESERVE: the seconds a step may take: at most CAP, and what the budget has left once
# RESERVE seconds are kept for the steps after it (at least 15).
cap() {
    local left=$((BUDGET - (SECONDS - START) - $2))
    local t=$1
    if [ "$left" -lt "$t" ]; then t=$left; fi
    if [ "$t" -lt 15 ]; then t=15; fi
    echo "$t"
}
note() { echo "[$((SECONDS - START)) s] $*" | tee -a "$SETUP"; }

note "install wheels"
timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$SETUP" 2>&1 || note "pip install failed (rc $?)"
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    nproc; free -g | head -2
    timeout 60 python3 -c 'import sys, torch, numpy, pyarrow, numba, zmq, pyorc, msgspec, cryptography
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(),
      "numpy", numpy.__version__, "pyarrow", pyarrow.__version__, "numba", numba.__version__, "pyzmq", zmq.__version__,
      "pyorc", pyorc.__version__, "msgspec", msgspec.__version__, "cryptography", cryptography.__version__)
import remoteloader; print("remoteloader", remoteloader.__version__, remoteloader.__file__)'
} >>"$SETUP" 2>&1

note "generate the ${ROWS}-row table in the background (while the CUDA tests run)"
timeout -k 10 150 python3 -m benchmarks.gpu_feed --only-table --table "$TABLE" --rows "$ROWS" >>"$SETUP" 2>&1 &
TABLE_PID=$!

t=$(cap 150 300)
note "CUDA tests and the CUDA soak (timeout $t s)"
REMOTELOADER_SOAK_ROWS=${SOAK_ROWS:-200000} timeout -k 10 "$t" python3 -m pytest -q -p no:cacheprovider -n0 \
    -o addopts="" -ra tests/test_pinning.py tests/test_cuda_soak.py -k cuda >"$OUT/cuda_tests.log" 2>&1
note "CUDA tests: rc $? ($(tail -1 "$OUT/cuda_tests.log"))"

wait "$TABLE_PID"
note "table: rc $?"

t=$(cap 200 150)
note "gpu_feed, $WORKERS workers (timeout $t s)"
echo "## gpu_feed: $WORKERS workers, $ROWS rows" >>"$RESULTS"
timeout -k 20 "$t" python3 -m benchmarks.gpu_feed --table "$TABLE" --rows "$ROWS" --workers "$WORKERS" \
    --device "$DEVICE" --seconds 8 --warmup-seconds 2 --start-timeout 60 --stall 25 >>"$RESULTS" 2>"$OUT/gpu_feed.log"
note "gpu_feed: rc $?"

t=$(cap 75 75)
note "sealed vs plain TCP, $WORKERS workers (timeout $t s)"
echo -e "\n## sealed vs plain TCP: $WORKERS workers" >>"$RESULTS"
timeout -k 20 "$t" python3 -m benchmarks.gpu_feed --table "$TABLE" --rows "$ROWS" --workers "$WORKERS" \
    --device "$DEVICE" --modes tcp,sealed --auth --seconds 8 --warmup-seconds 2 --start-timeout 40 --stall 20 \
    >>"$RESULTS" 2>"$OUT/transport.log"
note "transport: rc $?"

t=$(cap 110 0)
note "scaling 1,2,4,8,12 workers (timeout $t s)"
echo -e "\n## scaling" >>"$RESULTS"
timeout -k 20 "$t" python3 -m benchmarks.scaling --table "$TABLE" --rows "$ROWS" --workers 1,2,4,8,12 \
    --seconds 5 --warmup-seconds 1.5 --start-timeout 40 --stall 20 >>"$RESULTS" 2>"$OUT/scaling.log"
note "scaling: rc $?"
note "done in $((SECONDS - START)) s"
cat "$RESULTS"
