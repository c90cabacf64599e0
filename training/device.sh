#!/usr/bin/env bash
# The shipped model's whole training on a GPU machine that keeps /tmp only while it is held, in
# commands of under ten minutes each (docs/training.md):
#
#   training/device.sh start END_S DRAFTER_S  builds the corpus while the GPU training tests run
#                                             beside it, then trains the rest in a detached
#                                             process whose plan ends END_S seconds after this
#                                             command began; shows where it stands
#   training/device.sh wait S                 waits up to S seconds for the run, showing it
#   training/device.sh collect                packs the run's release, logs and record into $OUT
#
# RUN (default /tmp/run) is the pipeline's directory, RECIPE (default the shipped one) its
# recipe, ROOT (default this Python's stdlib and packages) the corpus's one source root.
set -u
RUN=${RUN:-/tmp/run}
args=(--out "$RUN" --recipe "${RECIPE:-glm-dsa-mini}" ${ROOT:+--root "$ROOT"})
SLACK_S=200  # of END_S kept for the stages' set-up, evaluations, the release and the drafter's start
export PYTHONUNBUFFERED=1

show() {
  for f in "$RUN"/target-*/history.jsonl; do
    [ -f "$f" ] && { echo "== $f"; grep -v '"bpb_by_position"' "$f" | tail -n 2 | cut -c1-400; }
  done
  [ -f "$RUN/train.log" ] && { echo "== train.log"; tr '\r' '\n' <"$RUN/train.log" | grep -v '^\s*$' | tail -n 4 | cut -c1-300; }
  [ -f "$RUN/pipeline.json" ] && cat "$RUN/pipeline.json"
}

running() { [ -f "$RUN/train.pid" ] && kill -0 "$(cat "$RUN/train.pid")" 2>/dev/null; }

case "$1" in
start)
  began=$(date +%s)
  mkdir -p "$RUN"
  python -m pytest -q -m gpu -p no:cacheprovider tests/training/test_mla_forward_gpu.py \
    >"$RUN/gpu_test.log" 2>&1 &
  tests=$!
  python -m training run "${args[@]}" --budget-s 1 --no-progress >"$RUN/corpus.log" 2>&1 \
    || { tail -n 30 "$RUN/corpus.log"; exit 1; }
  cat "$RUN/corpus/tokens.json"
  left=$(( $2 - ($(date +%s) - began) ))
  target=$(( left - $3 - SLACK_S ))
  [ "$target" -ge 60 ] || { echo "END_S leaves the target $target s: too little"; exit 1; }
  echo "corpus in $(( $(date +%s) - began )) s; training: $left s left, target $target s, drafter $3 s"
  setsid nohup python -m training run "${args[@]}" --budget-s "$left" --target-s "$target" \
    --drafter-s "$3" >"$RUN/train.log" 2>&1 </dev/null &
  echo $! >"$RUN/train.pid"
  wait "$tests"
  echo "gpu tests rc=$?"; tail -n 15 "$RUN/gpu_test.log"
  show
  ;;
wait)
  end=$(( $(date +%s) + $2 ))
  while running && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
  running && echo "still running" || echo "finished"
  show
  ;;
collect)
  (cd "$RUN" && tar -czf "$OUT/logs.tgz" pipeline.json ./*.log corpus/*.json)
  tar -C "$RUN" --exclude=trainer.pt -czf - release | split -b 15M - "$OUT/release.tgz.part-"
  ls -la "$OUT"
  ;;
*)
  echo "usage: $0 start END_S DRAFTER_S | wait S | collect" >&2
  exit 2
  ;;
esac
