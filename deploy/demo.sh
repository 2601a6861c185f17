#!/usr/bin/env bash
# The demo: installs dependencies, builds, starts foreshockd on loopback with
# an embedded SQLite database, streams a simulated multi-rank training run
# into it, and prints where to look. The daemon keeps running until Ctrl-C.
#
# Environment: FORESHOCK_DEMO_INGEST (default 127.0.0.1:7781),
#              FORESHOCK_DEMO_HTTP   (default 127.0.0.1:7782),
#              FORESHOCK_DEMO_ONCE=1 (stop the daemon after the simulation),
#              FORESHOCK_DEMO_SCENARIO (default attention-numerics; also healthy,
#              lr-spike, combined).
set -euo pipefail
cd "$(dirname "$0")/.."

INGEST=${FORESHOCK_DEMO_INGEST:-127.0.0.1:7781}
HTTP=${FORESHOCK_DEMO_HTTP:-127.0.0.1:7782}
RUN=demo-$(date +%Y%m%d-%H%M%S)

deploy/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" --target foreshockd foreshock_cli >/dev/null

mkdir -p build/demo
log=build/demo/foreshockd.log
build/foreshockd --listen "$INGEST" --http "$HTTP" --db build/demo/foreshock.db 2>"$log" &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null' EXIT INT TERM

for _ in $(seq 100); do
  grep -q "foreshockd ready" "$log" && break
  kill -0 "$pid" 2>/dev/null || { cat "$log"; echo "demo: foreshockd failed to start" >&2; exit 1; }
  sleep 0.1
done
grep "foreshockd ready" "$log"
echo "demo: dashboard at http://$HTTP/#run=$RUN (open it to watch the run arrive)"

SCENARIO=${FORESHOCK_DEMO_SCENARIO:-attention-numerics}
echo "demo: simulating run '$RUN' (4 ranks, 600 steps, scenario $SCENARIO) into $INGEST"
build/foreshock simulate --endpoint "$INGEST" --run "$RUN" --ranks 4 --steps 600 \
  --layers 2 --heads 4 --dh 16 --d 128 --sketch-every 5 --fault-step 300 \
  --scenario "$SCENARIO" --rate 200 | tee build/demo/simulate.out

# The monitors of the last steps are computed just after their reports are
# acknowledged; give the stage a moment, then show what fired.
sleep 2
echo
echo "demo: alerts of run $RUN (newest first):"
build/foreshock --http "$HTTP" alerts --run "$RUN"
build/foreshock --http "$HTTP" alerts --run "$RUN" --json |
  /usr/bin/python3 deploy/demo_summary.py build/demo/simulate.out

cat <<MSG

Foreshock is running (daemon pid $pid, log $log, database build/demo/foreshock.db).
  Dashboard: http://$HTTP/#run=$RUN
  Runs:      curl http://$HTTP/api/v1/runs
  The run:   curl http://$HTTP/api/v1/runs/$RUN
  Series:    curl 'http://$HTTP/api/v1/series?run=$RUN'
  Alerts:    curl 'http://$HTTP/api/v1/alerts?run=$RUN'
  CLI:       build/foreshock --http $HTTP runs
             build/foreshock --http $HTTP series --run $RUN
             build/foreshock --http $HTTP alerts --run $RUN
  Health:    curl http://$HTTP/readyz
  Metrics:   curl http://$HTTP/metrics
MSG
if [ "${FORESHOCK_DEMO_ONCE:-0}" = 1 ]; then
  exit 0
fi
echo "Press Ctrl-C to stop the daemon."
wait "$pid"
