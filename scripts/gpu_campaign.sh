#!/usr/bin/env bash
# Issue 26's campaign on a lent GPU machine, in one call of the device tool (its limits: at most 10
# minutes a call, 15 minutes of device time a session, nothing reachable from the machine).
#
# Prepare here, once (both folders are ignored through .git/info/exclude and travel with `carry: [".gpu"]`):
#   echo /.gpu/ >> .git/info/exclude; mkdir -p .gpu/data && cp -r ../shared/data/mnist .gpu/data/
#   .venv/bin/pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .gpu/whl flwr==1.42.0 && rm .gpu/whl/numpy-* .gpu/whl/uv-*     # torch and numpy are there
# Run there:  FEDFILTER_COMMIT=$(git rev-parse HEAD) BUDGET=480 N=2 ONLY='<regex>' bash scripts/gpu_campaign.sh
#
# BUDGET: seconds from the start to the end of the campaign (running jobs are then stopped and lost, so
# choose jobs that fit: on an H100 on 2026-11-27 a worker ran 0.48 steps/s with 3 workers and 0.33 with
# 8, the GPU 80-99 % busy, so a 150-step trial needs about 5 minutes even alone: docs/results.md).
# N workers of THREADS torch threads; ONLY: --only for every worker; GPU_TEST=1 also runs pytest -m gpu.
# What comes back under $OUT: the new result rows (new-rows.jsonl: append them to
# docs/results/fz_sec51.jsonl here and commit them), the workers' log, each job's rounds so far.
set -u
BUDGET=${BUDGET:-480}; N=${N:-2}; PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}; THREADS=${THREADS:-4}
OUT=${OUT:-/tmp/gpu-out}; WORK=${WORK:-/tmp/fzout}; mkdir -p "$OUT"
start=$SECONDS
if [ "$PY" = python3 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 11
  export PYTHONPATH=/tmp/site:$PWD
fi
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=$THREADS
$PY -c "import flwr, torch; print('flwr', flwr.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 12
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
echo "setup $((SECONDS - start)) s"
if [ -n "${GPU_TEST:-}" ]; then
  FEDFILTER_DATA_DIR=$PWD/.gpu/data timeout 300 $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider > "$OUT/gpu-test.log" 2>&1
  echo "pytest -m gpu: rc $? at $((SECONDS - start)) s"; tail -n 3 "$OUT/gpu-test.log"
fi
R=$PWD/docs/results/fz_sec51.jsonl
before=$(wc -l < "$R")
end=$((start + BUDGET))
worker() {
  while [ $SECONDS -lt $end ]; do
    rc=0
    $PY -m simulations.cli reproduce fz-mnist --campaign --once --device "$DEVICE" --threads "$THREADS" \
      ${ONLY:+--only "$ONLY"} --data-dir "$PWD/.gpu/data" --results "$R" --out "$WORK" >> "/tmp/w$1.log" 2>&1 || rc=$?
    echo "worker $1: rc $rc at $((SECONDS - start)) s" >> "/tmp/w$1.log"
    [ $rc = 5 ] && { sleep 5; continue; }  # every job it may take is held: wait for one to finish
    [ $rc = 0 ] || break                    # 3: nothing left; 4: a job failed twice
  done
}
for w in $(seq 1 "$N"); do worker "$w" & sleep 1; done
while [ $SECONDS -lt $end ] && [ -n "$(jobs -rp)" ]; do
  sleep 15
  echo "== $((SECONDS - start)) s: $(($(wc -l < "$R") - before)) new rows"
  for d in "$WORK"/campaign/*/; do [ -f "$d/rounds.jsonl" ] && echo "  $(basename "$d" | cut -c1-64) $(wc -l < "$d/rounds.jsonl")"; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
done
pkill -f -- "--out $WORK"; sleep 2
tail -n +$((before + 1)) "$R" > "$OUT/new-rows.jsonl"
for w in $(seq 1 "$N"); do tr '\r' '\n' < "/tmp/w$w.log" | grep -v '^\[#'; done > "$OUT/workers.log"
(cd "$WORK/campaign" && tar czf "$OUT/rounds.tgz" ./*/rounds.jsonl) 2>/dev/null
wc -l < "$OUT/new-rows.jsonl"
