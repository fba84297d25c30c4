#!/bin/bash
# One call on a lent CUDA GPU (the device tool's, ~9 minutes): the CUDA tests, where a plan's step
# time goes (experiments/plan_call.py), then issue #30's small table in every runtime
# (experiments/plan_run.py: plans searched one process per workload at once, then measured one
# workload at a time). Results land in $OUT (or ./device_out). Packages the GPU machine lacks
# travel as wheels in .whl/ (rustworkx at least; see the device tool's README):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl rustworkx
#   then run: bash experiments/device_check.sh   (carry: .whl)
export PYTHONUNBUFFERED=1
OUT=${OUT:-device_out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-540}  # seconds this script may take in all
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
python3 -c "import torch, transformers, magis; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"

echo "== CUDA tests"
timeout 170 python3 -m pytest -p no:cacheprovider -n 4 -rs -k cuda \
  tests/test_cuda_user_loop.py tests/test_device_kernels.py tests/test_cuda_graph.py tests/test_scheduling_rules.py \
  tests/test_rnn.py tests/test_capture.py tests/test_bit_masks.py tests/test_latency.py tests/test_user_hunt3.py \
  tests/test_codegen.py 2>&1 | tail -25 | tee "$OUT/tests.log"
echo "tests done at $(elapsed) s"

echo "== where the step time goes"
timeout 120 python3 experiments/plan_call.py --models resnet50 --preset small --device cuda --cost-model h200 \
  --limit 0.8 --profile --out "$OUT/plan_call.json" 2>&1 | grep -v "^magis" | tail -3

MODELS="resnet50 btlm-3b gpt-neo-1.3b unet unetpp bert-base vit-base"
COMMON="--preset small --device cuda --cost-model h200 --limits 0.8 --time-budget 10 --runs 5 --plans /tmp/plans --compile-plans --compile-peer"
echo "== search (one process per workload) at $(elapsed) s"
for m in $MODELS; do
  OMP_NUM_THREADS=2 timeout 200 python3 experiments/plan_run.py --models $m $COMMON --search-only > /tmp/search_$m.log 2>&1 &
done
wait
cat /tmp/search_*.log > "$OUT/search.log"
echo "== measure at $(elapsed) s"
LEFT=$(( BUDGET - $(elapsed) )); [ $LEFT -lt 60 ] && LEFT=60
timeout $LEFT python3 experiments/plan_run.py --models ${MODELS// /,} $COMMON \
  --out "$OUT/plan_run_small.json" 2>&1 | grep -v Warning | cut -c1-400 | tail -40
echo "all done at $(elapsed) s"
