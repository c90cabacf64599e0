#!/usr/bin/env bash
# The H200 runs behind docs/results.md, in parts that each fit one call of the device tool
# (at most 600 s) and leave at most 8 files under $OUT (what comes back).
#
#   bench/gpu_run.sh 1   # GPU tests, capacity (issue 5), step timeline, speculation (issue 6) ~470 s
#   bench/gpu_run.sh 2   # serving over the engine and over HTTP, 8K inputs (issue 11)    ~520 s
#   bench/gpu_run.sh 3   # serving at 32K inputs and C = 128 / 256 (issue 11)             ~330 s
#   bench/gpu_run.sh spec  # GPU tests and speculation alone (issue 6)                   ~330 s
#   bench/gpu_run.sh ab  # GPU tests, then hisparse vs adaptive at C = 32 / 48 under each
#                        # refill and capture setting, the default twice (run-to-run noise)
#
# Needs the corpus at data/stdlib.u8 (python -m training.target.corpus --out
# data/stdlib.u8) for the held-out prompts, and the Python packages of pyproject.toml.
set -u
OUT=${OUT:-/tmp/dhisparse-gpu}
mkdir -p "$OUT"
if [ ! -f data/stdlib.u8 ]; then
    echo "data/stdlib.u8 is missing: python -m training.target.corpus --out data/stdlib.u8" >&2
    exit 2
fi
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
SERVE="python bench/serving.py --modes resident,hisparse,adaptive --output-len 32 --duration-s 4 --warmup-s 1.5 --quiet"
case "${1:-}" in
1)
    stamp gpu tests
    timeout 60 python -m pytest -q -m gpu tests/worker tests/kv_host_store -p no:cacheprovider \
        2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
    stamp capacity
    timeout 250 python bench/capacity.py --host-gib 12 --probe-sessions 64 --trace \
        --out "$OUT/capacity.json" --plot "$OUT/capacity.png" > "$OUT/capacity.log" 2>&1
    tail -2 "$OUT/capacity.log"
    stamp step timeline: where a replayed decode step waits, per mode
    timeout 120 python bench/step_timeline.py > "$OUT/step_timeline.txt" 2>&1
    tail -9 "$OUT/step_timeline.txt"
    stamp spec: every drafter, paper schedule and online policy vs none, closed loop
    timeout 300 python bench/spec.py --concurrency 1,16,64 --widths "" \
        --out "$OUT/spec.json" --plot "$OUT/spec.png" > "$OUT/spec.log" 2>&1
    tail -2 "$OUT/spec.log"
    ;;
2)
    stamp serving, engine level
    timeout 230 $SERVE --concurrency 1,4,16,64 --spec-modes adaptive --spec-concurrency 4,64 \
        --drafters off,dflash,dspark,dflash2 --schedules fixed,paper,online --input-lens 8192 \
        --time-limit-s 200 --out "$OUT/serving.json" --plot "$OUT/serving" > "$OUT/serving.log" 2>&1
    tail -1 "$OUT/serving.log"
    stamp serving, HTTP level
    timeout 170 $SERVE --http --concurrency 1,4,16,64 --drafters off --input-lens 8192 \
        --time-limit-s 150 --out "$OUT/serving_http.json" --log-dir "$OUT/logs" \
        > "$OUT/serving_http.log" 2>&1
    tail -1 "$OUT/serving_http.log"
    stamp step series: 40 synchronised steps per mode, 8K contexts, the serving pools
    {   # resident holds 4 sessions of this pool: C = 4 only
        timeout 40 python bench/profile_step.py --model models/glm-10m --context 8192 --steps 2 \
            --rows 1 --series 40 --modes resident --concurrency 4 --pool-gib 0.0401
        timeout 90 python bench/profile_step.py --model models/glm-10m --context 8192 --steps 2 \
            --rows 1 --series 40 --modes hisparse,adaptive --concurrency 4,16 --pool-gib 0.0522 \
            --durable
    } 2>&1 | grep "=====" > "$OUT/step_series.log"
    (cd "$OUT" && tar czf logs.tgz logs *.log && rm -rf logs ./*.log)  # 8 files at most
    ;;
3)
    stamp serving, 32K inputs, C up to 256
    # a 32K prefill takes ~0.2 s: 128-token outputs and a 16 s window (after 6 s of warm-up,
    # which covers the first admissions' prefills) let requests finish inside the window
    timeout 560 python bench/serving.py --modes resident,hisparse,adaptive --output-len 128 \
        --duration-s 16 --warmup-s 6 --quiet \
        --concurrency 1,16,128,256 --drafters off,dflash --schedules online \
        --spec-modes adaptive --spec-concurrency 128,256 --input-lens 32768 --time-limit-s 520 \
        --out "$OUT/serving_32k.json" --plot "$OUT/serving_32k" --table "$OUT/serving_32k.md" \
        > "$OUT/serving_32k.log" 2>&1
    tail -1 "$OUT/serving_32k.log"
    ;;
spec)
    stamp gpu tests
    timeout 150 python -m pytest -q -m gpu tests/worker tests/kv_host_store -p no:cacheprovider \
        2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
    stamp spec: every drafter, paper schedule and online policy vs none, closed loop
    timeout 300 python bench/spec.py --concurrency 1,16,64 --widths "" \
        --out "$OUT/spec.json" --plot "$OUT/spec.png" > "$OUT/spec.log" 2>&1
    tail -2 "$OUT/spec.log"
    ;;
ab)
    stamp gpu tests
    timeout 90 python -m pytest -q -m gpu tests/worker tests/kv_host_store -p no:cacheprovider \
        2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
    AB="python bench/capacity.py --host-gib 12 --probe-sessions 0 --modes hisparse,adaptive \
        --concurrency 32,48"
    for v in default overlap consecutive default2; do
        case $v in
        overlap) flags=--overlap-refills ;;
        consecutive) flags="--graph-capture consecutive" ;;
        *) flags= ;;
        esac
        stamp "capacity A/B: $v $flags"
        timeout 150 $AB $flags --out "$OUT/ab_$v.json" >> "$OUT/ab.log" 2>&1
    done
    python bench/ab_table.py "$OUT"/ab_*.json | tee "$OUT/ab_table.md"
    ;;
*)
    echo "usage: bench/gpu_run.sh 1|2|3|spec|ab" >&2
    exit 2
    ;;
esac
stamp done
ls -la "$OUT"
