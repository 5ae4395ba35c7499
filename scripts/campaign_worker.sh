#!/usr/bin/env bash
# One worker of issue 26's campaign (`fedfilter reproduce fz-mnist --campaign`) on this machine's CPU.
#
#   mkdir -p fedfilter-out
#   nohup setsid nice -n 19 bash scripts/campaign_worker.sh 1 >> fedfilter-out/campaign-1.log 2>&1 < /dev/null &
#   nohup setsid nice -n 19 bash scripts/campaign_worker.sh 2 >> fedfilter-out/campaign-2.log 2>&1 < /dev/null &
#
# Each job runs in a process of its own, on a snapshot of the commit HEAD names when it starts (`git archive`
# into fedfilter-out/src-W): later jobs use code committed meanwhile, never uncommitted work. Workers share
# fedfilter-out/fz-mnist and the results file (each holds the job it runs; a stopped job goes on from its
# snapshot, in this machine's run folders only), and each landed job is its own commit of the results file.
#   W          the worker's name (its source folder); required
#   ONLY       a regular expression: take only jobs whose key it matches (default: any)
#   THREADS    torch threads a job (default 1: two workers at one thread beat one at two, docs/results.md)
#   DATA_DIR   the folder holding mnist/ (default ../shared/data beside the checkout, else fedfilter's default)
#   PY         the interpreter (default .venv/bin/python). A job imports the snapshot only: it runs with -P
#              (`python -m` would put the checkout first on sys.path), and without the editable install's
#              finder, which would find a module the snapshot lacks in the checkout
#   WAIT_S     seconds to wait while every job it may take is another worker's (default 300)
#   MAX_WAITS  waits in a row before it gives up (default 48: 4 hours; a GDP job waits for its gd+renyi
#              twin, which may be no worker's)
# It stops when fedfilter-out/campaign.hold exists (checked between jobs), when every job it may take is done
# (exit 3 of --once), when a job has failed twice (4), or after MAX_WAITS waits in a row (exit 5).
set -u -o pipefail
W=${1:?usage: campaign_worker.sh W (a name for this worker)}
case $W in *[!A-Za-z0-9_-]* | '') echo "campaign_worker.sh: W: expected letters, digits, - or _, got '$W'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
THREADS=${THREADS:-1}
for v in THREADS WAIT_S MAX_WAITS; do
  case ${!v:-1} in *[!0-9]* | '') echo "campaign_worker.sh: $v: expected a whole number, got '${!v}'" >&2; exit 2 ;; esac
done
# The job's interpreter: no editable-install finder (project modules come from PYTHONPATH, the snapshot, or not
# at all), then the CLI as `python -m simulations.cli` would run it.
BOOT='import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
sys.path[:] = [p for p in sys.path if not p.startswith("__editable__")]
runpy.run_module("simulations.cli", run_name="__main__", alter_sys=True)'
if [ -z "${DATA_DIR:-}" ] && [ -d "$ROOT/../shared/data" ]; then DATA_DIR=$(cd "$ROOT/../shared/data" && pwd); fi
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 OMP_NUM_THREADS=$THREADS
mkdir -p fedfilter-out
waits=0
while :; do
  if [ -e fedfilter-out/campaign.hold ]; then echo "campaign_worker.sh $W: fedfilter-out/campaign.hold: stopping"; exit 0; fi
  c=$(git rev-parse HEAD) || exit 2
  src=fedfilter-out/src-$W
  rm -rf "$src" && mkdir -p "$src" && git archive "$c" | tar -x -C "$src" || exit 2
  rc=0
  FEDFILTER_COMMIT=$c PYTHONPATH=$ROOT/$src "$PY" -P -c "$BOOT" reproduce fz-mnist --campaign --once --commit \
    --threads "$THREADS" ${ONLY:+--only "$ONLY"} ${DATA_DIR:+--data-dir "$DATA_DIR"} \
    --results "$ROOT/docs/results/fz_sec51.jsonl" || rc=$?
  case $rc in
    0) waits=0 ;;                           # a job landed (or failed once: the next pass tries it again)
    5) waits=$((waits + 1))                 # every job it may take is another worker's, or waits for its twin
       if [ "$waits" -gt "${MAX_WAITS:-48}" ]; then
         echo "campaign_worker.sh $W: no job to take after $((waits - 1)) waits: stopping"; exit 5
       fi
       sleep "${WAIT_S:-300}" ;;
    3) echo "campaign_worker.sh $W: every job it may take is done"; exit 0 ;;
    *) echo "campaign_worker.sh $W: fedfilter reproduce fz-mnist exited $rc: stopping"; exit "$rc" ;;
  esac
done
