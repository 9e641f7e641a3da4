#!/usr/bin/env bash
# One prepared GPU check: everything the CPU machine cannot measure, in priority order, each part under
# its own time limit so a slow part cannot take the others down. Results go under $OUT (default
# ./gpu_check_out); SUMMARY.md lists each part's exit status and where its output is.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh          # on a CUDA machine (~8 min on one H100/H200)
#   bash benchmarks/gpu_check.sh --cpu-smoke            # the same parts at tiny shapes on a CPU (~3-5 min)
#
# Parts:
#   1. compiled Triton kernel tests (TRITON_INTERPRET=0; adds bf16): if they pass, the kernel is verified on
#      this GPU and kernels/attention.py's TRITON_VERIFIED_ON_GPU may be set to True (by hand, in a commit
#      that records this run)
#   2. attention benchmark at the rollout shape: Triton vs SDPA + dense mask vs compiled FlexAttention
#   3. bf16 training throughput of the paper preset, eager vs torch.compile: steps/s, frames/s, MFU from
#      counted FLOPs (the attention backend is "auto", i.e. SDPA + mask until part 1 flips the switch)
#   3b. the same with the Triton backend opted in (ARVDM_ATTENTION_BACKEND=triton), eager only
#   4. cached sampling frames/s at 64 px (paper preset, bf16): cached eager, cached compiled, recomputing
set -u
cd "$(dirname "$0")/.."
SMOKE=0
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
SUMMARY="$OUT/SUMMARY.md"
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1

part() {  # part NAME LIMIT_S COMMAND...: run, keep stdout+stderr in $OUT/NAME.txt, note the exit status
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
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

if [ $SMOKE -eq 1 ]; then
  export OMP_NUM_THREADS=1
  part kernel_tests 600 env TRITON_INTERPRET=1 python -m pytest tests/test_kernels_triton.py -x -q -k "not bf16"
  part attention 300 env TRITON_INTERPRET=1 python benchmarks/attention.py --cpu-smoke --markdown "$OUT/attention.md"
  part train_speed 300 python benchmarks/train_speed.py --modes eager --warmup 1 --steps 1 --rounds 1 \
    --set model.image_size=16 --set data.resize=16 --set model.dim=32 --set model.depth=1 --set train.batch_size=2
  part sampling 300 python benchmarks/sampling_throughput.py --smoke --modes cached recompute
else
  part kernel_tests 240 env TRITON_INTERPRET=0 python -m pytest tests/test_kernels_triton.py -x -q
  KERNELS_RC=$LAST_RC
  part attention 150 python benchmarks/attention.py --markdown "$OUT/attention.md"
  part train_speed 300 python benchmarks/train_speed.py --preset paper --device cuda --warmup 3 --steps 5 --rounds 3
  if [ "$KERNELS_RC" -eq 0 ]; then  # the compiled kernel passed its tests: time training with it too
    part train_speed_triton 150 env ARVDM_ATTENTION_BACKEND=triton python benchmarks/train_speed.py \
      --preset paper --device cuda --modes eager --warmup 2 --steps 5 --rounds 2
  fi
  part sampling 200 python benchmarks/sampling_throughput.py --device cuda --bf16 --frames 64 --repeats 2
fi
echo
cat "$SUMMARY"
