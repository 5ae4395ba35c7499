#!/usr/bin/env bash
# Issue 26's campaign on a lent GPU machine, in one call of the device tool (its limits: at most 10
# minutes a call, 15 minutes of device time a session, nothing reachable from the machine).
#
# Prepare here, once (both folders are ignored through .git/info/exclude and travel with `carry: [".gpu"]`):
#   echo /.gpu/ >> .git/info/exclude; mkdir -p .gpu/data && cp -r ../shared/data/mnist .gpu/data/
#   .venv/bin/pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .gpu/whl flwr==1.42.0 && rm .gpu/whl/numpy-* .gpu/whl/uv-*     # torch and numpy are there
# Run there:  FEDFILTER_COMMIT=$(git rev-parse HEAD) BUDGET=520 ONLY='<regex>' bash scripts/gpu_campaign.sh
#
# BUDGET: seconds from the start to the campaign's deadline. Every pending job ONLY matches (at most N)
# starts at once; scripts/gpu_campaign.py stops, one at a time, the job with most rounds left while some
# job's pace says it cannot finish by then, and every job still running at the deadline (a stopped job
# is lost: its snapshot stays on the lent machine). THREADS torch threads a job; GPU_TEST=1 also runs
# pytest -m gpu beside the jobs. What comes back under $OUT: new-rows.jsonl (append the rows to
# docs/results/fz_sec51.jsonl here and commit them), progress.jsonl, workers.log, rounds.tgz.
set -u
BUDGET=${BUDGET:-520}; N=${N:-8}; PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}; THREADS=${THREADS:-2}
OUT=${OUT:-/tmp/gpu-out}; WORK=${WORK:-/tmp/fzout}; mkdir -p "$OUT"
start=$SECONDS
if [ "$PY" = python3 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 11
  export PYTHONPATH=/tmp/site:$PWD
fi
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 PYTHONUNBUFFERED=1
$PY -c "import flwr, torch; print('flwr', flwr.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 12
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
echo "setup $((SECONDS - start)) s"
if [ -n "${GPU_TEST:-}" ]; then
  (FEDFILTER_DATA_DIR=$PWD/.gpu/data timeout 300 $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider > "$OUT/gpu-test.log" 2>&1
   echo "pytest -m gpu: rc $? at $((SECONDS - start)) s" >> "$OUT/gpu-test.log") &
fi
$PY scripts/gpu_campaign.py --budget $((BUDGET - (SECONDS - start))) --only "${ONLY:?ONLY: which jobs}" --max-jobs "$N" \
  --threads "$THREADS" --device "$DEVICE" --data-dir "$PWD/.gpu/data" --results "$PWD/docs/results/fz_sec51.jsonl" \
  --work "$WORK" --out "$OUT"
rc=$?
wait
[ -f "$OUT/gpu-test.log" ] && tail -n 4 "$OUT/gpu-test.log"
exit $rc
