#!/usr/bin/env bash
# One pass over an accelerator machine: what is there, the platform contract and engine tests on
# it, cost-model measurements, and an `eddy eval` smoke run. Every step runs under a deadline,
# its output goes to a log in $OUT, and a failed step does not stop the next; the whole pass
# stays within TOTAL_S seconds (default 480).
#
#     OUT=/tmp/devout bash bench/device_check.sh      (from anywhere; runs in the repo root)
#
# $OUT receives at most 12 files: env.log, memory.log, memory.json, platform_check.log, platform_check.json, pytest.log,
# pytest.xml, hardware_report.jsonl,
# device_costs.log, device_costs.json, eval.log, summary.txt. Needs no Ray and no network; if
# .whl/ holds wheels (omegaconf, where the machine lacks it) they are installed to /tmp/site.
# On a machine without an accelerator the hardware tests skip and device_costs runs --quick.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_check}
ACCELERATOR=${ACCELERATOR:-H200}
TOTAL_S=${TOTAL_S:-480}  # the whole pass; each step's own limit is cut to what is left
mkdir -p "$OUT"
export EDDY_HARDWARE_REPORT="$OUT/hardware_report.jsonl"
: > "$EDDY_HARDWARE_REPORT"

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$OUT/env.log"
    if [[ ${PIPESTATUS[0]} != 0 ]]; then  # no pip: pure-python wheels are plain zip files
        for wheel in .whl/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site; done
    fi
fi
export PYTHONPATH=/tmp/site:$PWD

SUMMARY=()
step() {  # step NAME LOG LIMIT_S COMMAND...: run it with a deadline, log it, record how it ended
    local name=$1 log=$2 limit=$3 began=$SECONDS rc status command
    shift 3
    command="$*"
    if (( TOTAL_S - SECONDS < 20 )); then  # keep the whole pass inside the machine's lease
        SUMMARY+=("$name: skipped (TOTAL_S=${TOTAL_S} s spent)")
        return
    fi
    (( limit > TOTAL_S - SECONDS )) && limit=$((TOTAL_S - SECONDS))
    echo "=== $name: ${command:0:200} (limit ${limit} s) ===" | tee -a "$OUT/$log"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status=ok ;;
        124|137) status="timed out after ${limit} s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    SUMMARY+=("$name: $status in $((SECONDS - began)) s")
    echo "=== $name: $status ===" | tee -a "$OUT/$log"
}

ENV_INFO='
import platform, torch, transformers
print("python", platform.python_version(), "| torch", torch.__version__, "| transformers",
      transformers.__version__)
print("torch.version.cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "| devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0),
          "| bf16", torch.cuda.is_bf16_supported(), "| nccl", torch.cuda.nccl.version())
print("fp32 matmul precision", torch.get_float32_matmul_precision(),
      "| cuda.matmul.allow_tf32", torch.backends.cuda.matmul.allow_tf32,
      "| cudnn.allow_tf32", torch.backends.cudnn.allow_tf32)
'
if command -v nvidia-smi > /dev/null; then
    step nvidia-smi env.log 60 nvidia-smi
fi
step versions env.log 90 python3 -c "$ENV_INFO"
step platforms env.log 60 python3 -m eddyrl.cli platforms
PLATFORM=$(python3 -c "from eddyrl.hal import detect; print(detect().name)" 2>/dev/null || echo cpu)
# The shipped contract, as a vendor runs it from the wheel: every check, one table.
step "platforms check ($PLATFORM)" platform_check.log 240 python3 -m eddyrl.cli platforms check \
    "$PLATFORM" --json "$OUT/platform_check.json"

# Not -x: the device code has never run, and one failure must not hide the rest. The plug-in
# tests are left out: they exercise entry points on the CPU only, replace PYTHONPATH and (the
# training run) need Ray, which the device image lacks.
step pytest pytest.log 300 python3 -m pytest -q -p no:cacheprovider --timeout 150 -rfEs \
    --durations=15 --junitxml="$OUT/pytest.xml" tests/fast/hal tests/integration/hal tests/hardware \
    --ignore=tests/integration/hal/test_plugin.py --ignore=tests/integration/hal/test_plugin_train.py

step device_costs device_costs.log 240 python3 bench/device_costs.py \
    --accelerator "$ACCELERATOR" --out "$OUT/device_costs.json"

# issue 31: the memory plan against the device allocator's peak (rows that fit the device)
step memory memory.log 240 python3 bench/memory.py --device --json "$OUT/memory.json"

step "eval ($PLATFORM)" eval.log 150 python3 -m eddyrl.cli eval eddyrl/assets/tiny_warmstart \
    data.eval_size=64 "platform=$PLATFORM"

printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
for line in "${SUMMARY[@]}"; do
    [[ $line == *": ok in "* ]] || exit 1
done
