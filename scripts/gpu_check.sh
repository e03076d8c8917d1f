#!/usr/bin/env bash
# scripts/gpu_check.sh OUTDIR [--steps LIST] [--budget SECONDS] [--dry-run] [--force]
#
# Everything a session lent an NVIDIA GPU runs first, in one command of at most 10 minutes, on a
# machine with no network: builds attnx (its CUDA half for this GPU's architecture only), checks
# that C++ errors reach Python there (scripts/gpu_error_paths.py; if one crashes, rebuilds once
# with /usr/bin/gcc and g++ where those differ from the build's compilers), runs
# tests/test_cuda.py (with the cuda cases of the modifier, varlen, KV-cache, mask-dtype and
# autocast tests), tests/test_triton.py, tests/test_triton_configs.py and
# tests/test_mask_dtypes.py on CUDA tensors, `attnx check`,
# compute-sanitizer (memcheck, racecheck) on small cases of both GPU backends
# (scripts/gpu_sanitize_cases.py) and the GPU benchmarks (benchmarks/gpu_additive_targets.py,
# then benchmarks/gpu.py). Writes OUTDIR/gpu_check.json and OUTDIR/gpu_check.log.
#
# Each step runs under `timeout`: its cap below, or less when the whole --budget (default 570 s)
# runs short; a step stopped by its timeout is recorded as timed_out, one that got no time as
# skipped, and the benchmark is told its deadline so that it stops in time and keeps what it
# measured. Exit status 0 when every step passed (or there is no GPU: nothing is run, the JSON
# says why), 1 otherwise, 2 for bad arguments.
#
# Steps: build errors test_cuda test_triton check memcheck racecheck bench (default: these, in
# this order), and, only when named: profile (Nsight Compute on one call of each kernel whose
# target issue 21 misses, scripts/gpu_profile_cases.py, with --clock-control none as the device
# notes ask: OUTDIR/profile.ncu-rep, profile_raw.csv (every counter), profile_sass.csv.gz (the
# per-instruction samples) and, in the JSON, each kernel's time, throughputs, occupancy and
# largest stall reasons, scripts/gpu_profile_report.py) and cpu (the CPU targets on the
# machine's host CPU, two cores pinned as on the development machines; the device machines'
# host has been the Intel Xeon of issue 20, family 6 model 207, which the development machines
# rarely are). Caps in seconds, overridable as GPU_CHECK_CAP_<step>=N: build 300, errors 260
# (room for a crashed probe's backtrace and a rebuild), test_cuda 120, test_triton 240, check
# 90, memcheck 120, racecheck 120, bench 600 (what is left), profile 240 (not yet timed: the
# triton case autotunes first where bench did not), cpu 120 (the --quick targets: about 30 s on
# two cores). Taken
# on the H200, 2026-12-04: build 121 s, errors 170 (the /opt/gcc build crashed, rebuilt),
# test_cuda 61, test_triton 113, the cuda sanitizer cases 13-18 s a tool, gpu.py's 16 bf16
# cases of 4 providers 137. test_triton runs each kernel on the first
# config its pruning keeps (ATTNX_TRITON_AUTOTUNE=0: tuning every test shape took the whole step
# on 2026-11-26; test_triton_configs.py runs every config).
#
# The test steps run under pytest-xdist where installed (the device image has it), with
# CUDA_LAUNCH_BLOCKING=1 (a faulting kernel fails its own test) and tracebacks printed as
# failures happen (ATTNX_REPORT_FAILURES_AT_ONCE, tests/conftest.py): a test that crashes its
# worker, or leaves its CUDA context unusable, ends that worker, and xdist starts a fresh one
# for the rest, so one bad kernel does not fail every later test (as it did on 2026-11-26).
#
# memcheck and racecheck sanitize the cuda cases first, then the triton ones, whose first
# unsanitized run does the compiles and Triton's autotuning (cached on disk) outside the
# sanitizer; the step fails if either sanitized run does.
#
# Through the device tool (python3 there is the one with torch 2.11, Triton, pytest):
#   run(command="bash scripts/gpu_check.sh $OUT", timeout_s=600)
# or, with attnx._C compiled here beforehand for that machine's Python and torch (no GPU needed;
# bash scripts/gpu_prebuild.sh 9.0 for the H100 and the H200), which the build step then takes
# instead of compiling (121 s of the H200's device time on 2026-12-04):
#   run(command="bash scripts/gpu_check.sh $OUT", timeout_s=600,
#       carry=["attnx/_C.cpython-312-x86_64-linux-gnu.so", "attnx/_C.cpython-312-x86_64-linux-gnu.so.sources"])
# (the log's build step says whether it was taken; the errors step then tests this module, not
# one of the GPU machine's compilers, unless a crash makes it rebuild there)
# If the benchmark got too little time, a second call on the still-warm machine (the build is
# kept; a fresh machine rebuilds), with the profile after it:
#   run(command="bash scripts/gpu_check.sh $OUT --steps build,bench,profile", timeout_s=600)
# and join the two JSON files here with
#   python scripts/gpu_check_report.py merge -o all.json run1/gpu_check.json run2/gpu_check.json
# and set its benchmark against the last committed one of the same device (slower/faster past the
# runs' spread and 5% between machines; exit 1 when a case got slower):
#   python scripts/gpu_check_report.py compare all.json benchmarks/results/gpu-h200-2026-12-04.jsonl
# The decoding benchmark (attention_with_kvcache, triton, against torch's SDPA and the copy
# bandwidth) is its own call on the warm machine:
#   run(command="python3 benchmarks/gpu_decode.py --out $OUT/decode.jsonl --deadline-s 400", timeout_s=600)
# and so is the packed-batch one (varlen_attention, cuda and triton, against torch's varlen
# flash kernel and its SDPA on the padded batch):
#   run(command="python3 benchmarks/gpu_varlen.py --out $OUT/varlen.jsonl --deadline-s 300", timeout_s=600)
# Python packages missing there travel as wheels (/work/.library/device/README.md): put them in
# .whl/ at the repository root (ignored through .git/info/exclude), name .whl in the call's
# carry, and this script installs them into a scratch folder on PYTHONPATH before the steps.
set -uo pipefail

usage() { sed -n '2p' "$0" | sed 's/^# //' >&2; exit 2; }
DEFAULT_STEPS="build,errors,test_cuda,test_triton,check,memcheck,racecheck,bench"
ALL_STEPS="$DEFAULT_STEPS,profile,cpu"
declare -A CAP=([build]=300 [errors]=260 [test_cuda]=120 [test_triton]=240 [check]=90 [memcheck]=120
                [racecheck]=120 [bench]=600 [profile]=240 [cpu]=120)

outdir="" steps="$DEFAULT_STEPS" budget=570 dry_run=0 force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) [ $# -ge 2 ] || usage; steps="$2"; shift 2 ;;
    --budget) [ $# -ge 2 ] || usage; budget="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --force) force=1; shift ;;  # run the steps even without a GPU (they then fail or skip)
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; usage ;;
    *) [ -z "$outdir" ] || { echo "gpu_check.sh: one OUTDIR, got '$outdir' and '$1'" >&2; usage; }
       outdir="$1"; shift ;;
  esac
done
[ -n "$outdir" ] || { echo "gpu_check.sh: OUTDIR is required" >&2; usage; }
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget: expected whole seconds, got '$budget'" >&2; exit 2; }
for s in ${steps//,/ }; do
  [[ ",$ALL_STEPS," == *",$s,"* ]] || { echo "gpu_check.sh: --steps: unknown step '$s' (steps: $ALL_STEPS)" >&2; exit 2; }
done
for s in "${!CAP[@]}"; do  # GPU_CHECK_CAP_<step> overrides
  v="GPU_CHECK_CAP_$s"; [ -z "${!v:-}" ] || CAP[$s]="${!v}"
done

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
REPORT="$PY $root/scripts/gpu_check_report.py"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The Triton autotuner's choices go to disk, so the sanitizer runs reuse them (gpu_sanitize_cases.py).
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$root/build/triton-cache}"
unset TRITON_INTERPRET ATTNX_CUDA_ON_CPU  # the GPU backends on CUDA tensors, not the test switches
t0=$(date +%s)
say() { echo "$*" | tee -a "$log"; }

# the command of each step (run from the repository root)
command_of() {
  case "$1" in
    build) echo "$PY scripts/gpu_prebuilt.py check . '$arch' || { $(compile_command); }" ;;
    errors) echo "$PY scripts/gpu_error_paths.py || { $(other_compilers) && echo 'a probe failed: rebuilding with /usr/bin/gcc and /usr/bin/g++' && CC=/usr/bin/gcc CXX=/usr/bin/g++ $(compile_command) && $PY scripts/gpu_error_paths.py; }" ;;
    test_cuda) echo "$tests $PY -m pytest tests/test_cuda.py tests/test_modifiers.py tests/test_varlen.py tests/test_kvcache.py tests/test_mask_dtypes.py tests/test_autocast.py tests/test_compile.py -k cuda -v -rs -p no:cacheprovider$xdist" ;;
    test_triton) echo "$tests ATTNX_TRITON_AUTOTUNE=0 $PY -m pytest tests/test_triton.py tests/test_triton_configs.py tests/test_mask_dtypes.py -v -rs -p no:cacheprovider$xdist" ;;
    check) echo "$PY -m attnx check --jobs $jobs --json $scratch/check.json" ;;
    memcheck) echo "$(sanitized memcheck PYTORCH_NO_CUDA_MEMORY_CACHING=1)" ;;
    racecheck) echo "$(sanitized racecheck)" ;;
    profile) echo "$ncu --profile-from-start off --clock-control none$(printf ' --section %s' $NCU_SECTIONS) -f -o $outdir/profile $PY scripts/gpu_profile_cases.py && $ncu --import $outdir/profile.ncu-rep --page raw --csv > $outdir/profile_raw.csv && $PY scripts/gpu_profile_report.py $outdir/profile_raw.csv $scratch/profile.json && { $ncu --import $outdir/profile.ncu-rep --page source --csv --print-source sass | gzip > $outdir/profile_sass.csv.gz || echo 'no per-instruction page (the counters above stand)'; }" ;;
    cpu) echo "lscpu | grep -m1 'Model name'; taskset -c 0,1 env OMP_NUM_THREADS=2 $PY benchmarks/cpu_sdpa_targets.py --quick --out $outdir/cpu_sdpa_targets.json && taskset -c 0,1 env OMP_NUM_THREADS=2 $PY benchmarks/cpu_decode_targets.py --quick --threads 2 --out $outdir/cpu_decode_targets.json" ;;
    bench) echo "timeout 90 $PY benchmarks/gpu_additive_targets.py --repeats 5 --out $outdir/gpu_additive_targets.json; $PY benchmarks/gpu.py --out $scratch/bench.jsonl --deadline-s \$(( \$DEADLINE - 90 ))" ;;
  esac
}

# attnx built in place, its CUDA half for this GPU's architecture only (the build step runs it
# unless a carried prebuilt module serves: scripts/gpu_prebuild.sh, scripts/gpu_prebuilt.py).
compile_command() {
  echo "env ATTNX_CUDA=1 ATTNX_CUDA_ARCHS='$arch' MAX_JOBS=$(nproc) $PY setup.py build_ext --inplace && $PY -c 'import attnx, sys; i = attnx._ops.build_info(); print(i); sys.exit(0 if i and i[\"cuda\"] else \"attnx._C was built without CUDA\")'"
}

# Nsight Compute: on the PATH, or the newest under /opt/nvidia (the device image's place for it).
ncu="$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)"
ncu="${NCU:-${ncu:-ncu}}"
# what the profile step collects: speed of light, launch and occupancy, the schedulers' issue and
# the warps' stall reasons, pipes, instruction mix, memory, and per-instruction samples
NCU_SECTIONS="SpeedOfLight LaunchStats Occupancy SchedulerStats WarpStateStats ComputeWorkloadAnalysis InstructionStats MemoryWorkloadAnalysis SourceCounters"

# Whether the system's gcc/g++ exist and differ from the compilers the build used (CC/CXX, or
# cc/c++ on the PATH): the errors step then rebuilds with them when a C++ error crashes.
other_compilers() {
  echo "[ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ] && [ \"\$(readlink -f /usr/bin/g++)\" != \"\$(readlink -f \"\$(command -v \${CXX:-c++})\")\" ]"
}

# The sanitizer run of a step: the cuda cases, then the triton ones after an unsanitized run
# (compiles and autotuning cached on disk); fails if either sanitized run does.
sanitized() {
  local san="compute-sanitizer --tool $1 --error-exitcode 1 $PY scripts/gpu_sanitize_cases.py"
  echo "${2:+$2 }$san cuda; a=\$?; $PY scripts/gpu_sanitize_cases.py triton >/dev/null; ${2:+$2 }$san triton; exit \$(( a | \$? ))"
}

# Triton compiles every new kernel variant on one core: the Triton tests and the check spread
# over processes (pytest-xdist where installed; the device image has it).
jobs=$(( $(nproc) * 3 / 4 > 1 ? $(nproc) * 3 / 4 : 1 ))
tests="env CUDA_LAUNCH_BLOCKING=1 ATTNX_REPORT_FAILURES_AT_ONCE=1"
xdist=""
if "$PY" -c 'import xdist' >/dev/null 2>&1; then xdist=" -n $jobs"; fi
gpu_reason="" arch="8.0;9.0"  # without a GPU (--force, --dry-run): setup.py's architectures
if ! command -v nvidia-smi >/dev/null 2>&1; then
  gpu_reason="no NVIDIA GPU here (no nvidia-smi)"
elif ! arch="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)"; then
  gpu_reason="torch ($PY) sees no CUDA device" arch="8.0;9.0"
fi

if [ "$dry_run" = 1 ]; then
  echo "gpu_check.sh: dry run, nothing is run; budget ${budget} s; GPU: ${gpu_reason:-present (arch $arch)}"
  scratch='$SCRATCH'  # a temporary folder in a real run
  for s in ${steps//,/ }; do
    printf '  %-11s cap %4s s: %s\n' "$s" "${CAP[$s]}" "$(command_of "$s")"
  done
  exit 0
fi

mkdir -p "$outdir" && outdir="$(cd "$outdir" && pwd)"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
log="$outdir/gpu_check.log"
: > "$log"
if [ -n "$gpu_reason" ] && [ "$force" = 0 ]; then
  say "gpu_check.sh: $gpu_reason: nothing run (the steps need an NVIDIA GPU; --dry-run shows them)"
  for s in ${steps//,/ }; do $REPORT skip "$scratch/steps.jsonl" "$s" "$gpu_reason" -- "$(command_of "$s")" >> "$log"; done
  $REPORT finish "$outdir" "$scratch" "$budget" "$steps" --no-gpu "$gpu_reason" | tee -a "$log"
  exit "${PIPESTATUS[0]}"
fi

# Wheels carried in .whl/ (see the header): installed into a scratch folder on PYTHONPATH.
if compgen -G "$root/.whl/*.whl" >/dev/null; then
  say "installing the carried wheels: $(ls "$root"/.whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$scratch/site" "$root"/.whl/*.whl >> "$log" 2>&1 || say "wheel install failed (see above)"
  export PYTHONPATH="$PYTHONPATH:$scratch/site"
fi

reserve=20  # seconds kept for writing the JSON at the end
for s in ${steps//,/ }; do
  left=$(( t0 + budget - reserve - $(date +%s) ))
  cmd="$(command_of "$s")"
  if [ "$left" -lt 10 ]; then
    $REPORT skip "$scratch/steps.jsonl" "$s" "out of time: the ${budget} s budget was spent" -- "$cmd" | tee -a "$log"
    continue
  fi
  limit=$(( CAP[$s] < left ? CAP[$s] : left ))
  cmd="${cmd//\$DEADLINE/$(( limit - 30 > 10 ? limit - 30 : 10 ))}"
  say "=== [$(( $(date +%s) - t0 )) s] $s (timeout $limit s): $cmd"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$cmd" > "$scratch/$s.out" 2>&1
  rc=$?
  cat "$scratch/$s.out" >> "$log"
  tail -n 5 "$scratch/$s.out"
  $REPORT record "$scratch/steps.jsonl" "$s" "$rc" "$(( $(date +%s) - start ))" "$limit" \
    "$scratch/$s.out" -- "$cmd" | tee -a "$log"
done

say "=== [$(( $(date +%s) - t0 )) s] writing $outdir/gpu_check.json"
$REPORT finish "$outdir" "$scratch" "$budget" "$steps" | tee -a "$log"
exit "${PIPESTATUS[0]}"
