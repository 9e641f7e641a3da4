#!/usr/bin/env bash
# One prepared GPU check: everything the CPU machine cannot measure, in priority order, each part under
# its own time limit and all of them under one budget, so a slow part cannot take the others down.
# Results go under $OUT (default ./gpu_check_out); SUMMARY.md lists each part's exit status and output.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh          # on a CUDA machine (~10 min on one H200)
#   bash benchmarks/gpu_check.sh --cpu-smoke            # the same parts at tiny shapes on a CPU (~3-5 min)
#
# Environment: GPU_CHECK_BUDGET (seconds for all parts, default 600; a part gets at most what is left and is
# skipped under 20 s), SPEC_RUN (a trained run or checkpoint folder for part 5, default runs/tiny) and
# SPEC_DATA (its data set, default: the run's). `python` is python3 where no `python` is on the PATH, and
# the repository root is put on PYTHONPATH (the package need not be installed, e.g. on a bare GPU image).
#
# Parts:
#   (on the GPU the parts run in the order 2, 5, 3, 1, 4, 6; GPU_CHECK_PARTS="train_speed kernel_tests" picks)
#   1. compiled Triton kernel tests (TRITON_INTERPRET=0; adds bf16; pytest-xdist spreads the autotuner's
#      compiles over the cores when it is installed): if they pass, the kernel is verified on this GPU and
#      kernels/attention.py's TRITON_VERIFIED_ON_GPU may be set to True (by hand, in a commit that records
#      this run)
#   2. bf16 training throughput of the paper preset, eager vs torch.compile: steps/s, frames/s, MFU from
#      counted FLOPs (the attention backend is "auto", i.e. SDPA + mask until part 1 flips the switch)
#   3. cached sampling frames/s at 64 px (paper preset, bf16): cached eager, cached compiled, recomputing
#   4. attention benchmark at the rollout shape: Triton vs SDPA + dense mask vs compiled FlexAttention
#   5. speculative rows against plain sampling on a trained run, batch 1 (benchmarks/speculation.py): where
#      a batch of L windows costs about one call, the batched verification the CPU cannot pay for
#   6. part 2 with the Triton backend opted in (ARVDM_ATTENTION_BACKEND=triton), eager only, if part 1 passed
set -u
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
SUMMARY="$OUT/SUMMARY.md"
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET="${GPU_CHECK_BUDGET:-600}"
SPEC_RUN="${SPEC_RUN:-runs/tiny}"
if ! command -v python >/dev/null 2>&1; then  # e.g. an image with python3 only: `timeout` needs a file
  SHIM=$(mktemp -d)
  ln -s "$(command -v python3)" "$SHIM/python"
  export PATH="$SHIM:$PATH"
fi

part() {  # part NAME LIMIT_S COMMAND...: run, keep stdout+stderr in $OUT/NAME.txt, note the exit status
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS left=$((BUDGET - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    LAST_RC=125
    echo "| $name | SKIPPED (budget spent) | 0 s | \`$*\` |" >>"$SUMMARY"
    return
  fi
  echo "== $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  LAST_RC=$rc
  local verdict=ok
  [ $rc -ne 0 ] && verdict="FAILED (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"
  echo "| $name | $verdict | $((SECONDS - t0)) s | \`$*\` |" >>"$SUMMARY"
  tail -n 12 "$OUT/$name.txt"
}

{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) (smoke=$SMOKE)"
  echo
  echo '```'
  git log -1 --oneline 2>/dev/null || true
  python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  python -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton not importable"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  echo '```'
  echo
  echo "| part | result | time | command |"
  echo "|---|---|---|---|"
} >"$SUMMARY"

SPEC_ARGS=(--run "$SPEC_RUN" --out "$OUT/speculation" ${SPEC_DATA:+--data "$SPEC_DATA"})
if [ $SMOKE -eq 1 ]; then
  export OMP_NUM_THREADS=1
  part kernel_tests 600 env TRITON_INTERPRET=1 python -m pytest tests/test_kernels_triton.py -x -q -k "not bf16"
  part train_speed 300 python benchmarks/train_speed.py --modes eager --warmup 1 --steps 1 --rounds 1 \
    --set model.image_size=16 --set data.resize=16 --set model.dim=32 --set model.depth=1 --set train.batch_size=2
  part sampling 300 python benchmarks/sampling_throughput.py --smoke --modes cached recompute
  part attention 300 env TRITON_INTERPRET=1 python benchmarks/attention.py --cpu-smoke --markdown "$OUT/attention.md"
  if [ -e "$SPEC_RUN" ]; then
    part speculation 300 python benchmarks/speculation.py "${SPEC_ARGS[@]}" --quick --configs plain,fixed:2,ucb
  fi
else
  # cheapest and most telling first; the kernel tests (the autotuner compiles 8 tile configs per kernel and
  # shape: minutes) come after the timings so that a slow compile cannot starve them
  want() { [ -z "${GPU_CHECK_PARTS:-}" ] || [[ " $GPU_CHECK_PARTS " == *" $1 "* ]]; }
  # batch 8: the paper preset's batch of 32 does not fit an H200 in fp32 (SDPA's math path under the mask)
  want train_speed && part train_speed 120 python benchmarks/train_speed.py --preset paper --device cuda \
    --modes fp32 eager --set train.batch_size=8 --warmup 2 --steps 5 --rounds 2
  want speculation && [ -e "$SPEC_RUN" ] && part speculation 90 python benchmarks/speculation.py "${SPEC_ARGS[@]}" \
    --device cuda --episodes 1 --frames 16 --steps 50 --repeats 2 --configs plain,fixed:2,fixed:4,ucb,exp3
  want sampling && part sampling 60 python benchmarks/sampling_throughput.py --device cuda --bf16 --frames 8 \
    --repeats 1 --modes cached recompute
  XDIST=()
  python -c "import xdist" 2>/dev/null && XDIST=(-n 16)
  KERNELS_RC=1
  if want kernel_tests; then
    part kernel_tests 300 env TRITON_INTERPRET=0 python -m pytest tests/test_kernels_triton.py -v -rf \
      --durations 8 -p no:benchmark "${XDIST[@]}"
    KERNELS_RC=$LAST_RC
    pkill -9 -f "sys.stdin.readline" 2>/dev/null  # execnet (xdist) workers can outlive a timed-out pytest
  fi
  want attention && part attention 120 python benchmarks/attention.py --warmup 10 --iters 40 \
    --markdown "$OUT/attention.md"
  if [ "$KERNELS_RC" -eq 0 ] && want train_speed_triton; then  # the compiled kernel passed: train with it too
    part train_speed_triton 90 env ARVDM_ATTENTION_BACKEND=triton python benchmarks/train_speed.py \
      --preset paper --device cuda --modes eager --set train.batch_size=8 --warmup 2 --steps 5 --rounds 2
  fi
fi
echo
cat "$SUMMARY"
