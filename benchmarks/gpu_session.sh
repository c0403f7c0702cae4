#!/usr/bin/env bash
# A GPU session's checks and figures, in parts of about five minutes each on one H100/H200
# (each part fits one call of a lent GPU machine; the figures need the GPU to themselves):
#
#   bash benchmarks/gpu_session.sh figures OUTDIR  # MoCo v2 R50 vs PyTorch, DINO ViT-S/B
#   bash benchmarks/gpu_session.sh presets OUTDIR  # every test preset in bf16, stop + resume
#   bash benchmarks/gpu_session.sh tests OUTDIR    # models, losses, methods, optim on the GPU
#   bash benchmarks/gpu_session.sh checks OUTDIR   # presets and tests at once (untimed; 6 min)
#   bash benchmarks/gpu_session.sh vits OUTDIR     # DINO ViT-S/16 and ViT-B/16 alone
#   bash benchmarks/gpu_session.sh table OUTDIR    # every method's step, largest batch, profile
#     (about 9 min; run it again to go on where a call's limit cut it: the compilation cache,
#     what was compiled and the rows timed stay in /tmp/jssl-table while the machine is held;
#     count the steps' FLOPs on a CPU before: python benchmarks/method_steps.py
#     --count=.whl/flops-counts.json, and pass JSSL_FLOPS=.whl/flops-counts.json)
#
# A GPU host may lack TensorFlow and a network: jssl's core needs neither (the demo data is
# generated with numpy). Wheels in .whl/ (e.g. ml-collections, clu) are installed first when
# present. Results files (named <benchmark>-<chip>, benchmarks/results.py) and logs go to
# OUTDIR (a lent machine returns 8 files: tar the folder); copy the results files to
# benchmarks/results/ and run benchmarks/report.py.
set -u -o pipefail
part=${1:?figures, vits, presets, tests or checks}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
# Once per session: a part that calls other parts has already done this for them.
if [ -z "${JSSL_GPU_SESSION:-}" ]; then
  export JSSL_GPU_SESSION=1
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # The machine and package versions, as each results file records them.
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import results; print(results.machine())"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
fi
quiet() { grep -v "^[IW][0-9]\|^WARNING: All log\|^[IW]0000" | cut -c1-400; }

case $part in
table)
  # Every method at its ImageNet shapes (benchmarks/method_steps.py), then the MoCo profile.
  mkdir -p /tmp/jssl-table
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}  # the fits
  timeout "${JSSL_TABLE_TIMEOUT:-540}" python3 benchmarks/method_steps.py \
    --deadline_s="${JSSL_TABLE_DEADLINE:-450}" --cache_dir=/tmp/jssl-table \
    --partial=/tmp/jssl-table/rows.jsonl --trace=/tmp/jssl-table/trace \
    --results="$out/method_steps.json" ${JSSL_FLOPS:+--flops=$JSSL_FLOPS} 2>&1 |
    quiet | tee "$out/method_steps.log" | grep -v "^compiled"
  cp /tmp/jssl-table/rows.jsonl /tmp/jssl-table/compiled.json "$out/" 2>/dev/null
  if [ -d /tmp/jssl-table/trace ]; then
    python3 benchmarks/trace_summary.py /tmp/jssl-table/trace --top 30 >"$out/trace_summary.txt"
    head -c 15000000 "$(find /tmp/jssl-table/trace -name '*.trace.json.gz' | head -1)" \
      >"$out/moco.trace.json.gz"
  fi
  ;;
figures)
  # The train engine end to end first (a minute): nothing else is worth timing if it fails.
  timeout 150 python3 benchmarks/presets.py --methods=moco --results="$out/presets-moco.json" \
    2>&1 | quiet | tail -3 || exit 1
  # The anchor: MoCo v2 ResNet-50 224 px bf16, batch 256 per GPU, against PyTorch.
  timeout 200 python3 benchmarks/train_step.py --compare_torch --cases=r50_224_b256 \
    --dtypes=bfloat16 --rounds=1 --steps=20 --results="$out/train_step-compare_torch.json" \
    2>&1 | quiet | tail -4
  bash "$0" vits "$out"
  ;;
vits)
  # DINO ViT-S/16 and ViT-B/16, 2 x 224 + 10 x 96 px crops (about 100 s each).
  for case in vit_s16_224_b128 vit_b16_224_b64; do
    timeout 130 python3 benchmarks/train_step.py --methods=dino --cases=$case \
      --dtypes=bfloat16 --steps=10 --results="$out/train_step-dino-$case.json" 2>&1 |
      tee "$out/train_step-dino-$case.log" | quiet | tail -4
  done
  ;;
checks)
  # The untimed checks share the machine: presets in the background, the tests beside them.
  bash "$0" presets "$out" >"$out/presets.out" 2>&1 &
  bash "$0" tests "$out" 3
  wait
  cat "$out/presets.out"
  ;;
presets)
  # Compiling is the CPU's work: eight processes of two presets share the GPU.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  groups=(moco,mocov3 simclr,swav byol,simsiam dino,dino_vit barlow_twins,vicreg supervised,mae
    ibot,dinov2 msn,deepclusterv2)
  for i in "${!groups[@]}"; do
    timeout 330 python3 benchmarks/presets.py --methods="${groups[$i]}" \
      --results="$out/presets-$i.json" >"$out/presets-$i.log" 2>&1 &
  done
  wait
  cat "$out"/presets-?.log | quiet | grep "^{\|presets\|failed"
  ;;
tests)
  # -v names every test as it finishes, so a run cut short still says which failed.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  JAX_PLATFORMS=cuda timeout 320 python3 -m pytest tests/models tests/losses tests/methods \
    tests/optim -n "${3:-8}" --dist loadfile -v -p no:cacheprovider --continue-on-collection-errors \
    --tb=short --timeout=150 >"$out/tests.log" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$out/tests.log" | cut -c1-300 | tail -60
  ;;
esac
