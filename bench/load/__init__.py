"""``python -m bench load`` (issue 45): the paper's load evaluation at real dimensions —
sessions held, decode throughput and latency under closed-loop load, C from 1 to well beyond
resident capacity, every mode at equal GPU memory, speculation off / fixed / paper / online.

    python -m bench load --family v32-scaled --contexts 32768 --concurrency 1,8,32,64 \
        --out docs/results/load.json --plot docs/results/load      # one GPU part
    python -m bench load --tiny --out /tmp/load.json                # the CPU smoke run

For each family (``v32-scaled``, ``glm5-scaled``: real per-layer dimensions, FP8 weights and KV)
and each context (input length), ``--prefixes`` prepared histories are drawn and imported
without prefill (``history``: each request's complete pages seated as a finished prefill leaves
them; the prompt's last tokens, at most a page, are prefilled). Every mode's engine gets the
same KV budget (``pool``: what the full model leaves per GPU on 8 H200 under its best layout,
scaled by the layer ratio; printed and in ``sizing``) plus its own fixed allocations, and the
hierarchy engines share one host arena (the node's host memory per GPU, scaled alike, at most
``--host-cap-gib``). Closed-loop clients (``bench/serving/loop.py``) keep one request each in
flight, ``--output-len`` tokens greedily, EOS ignored.

Two lockstep groups per context (``bench/core/lockstep.py``: the variants of one C stepped in
turn, each on its own clock): the modes without speculation at each C of ``--concurrency``,
the C ``--noise-concurrency`` run twice (the run-to-run noise); then ``--spec-mode`` without
speculation and with the MTP layer under each width schedule of ``--spec`` at each C of
``--spec-concurrency``, each verify round's acceptance under the bench's control
(``bench/spec_control.py``, ``force``: the MTP layer's own proposals, accepted at the shipped
model's rates by draft position).

Output JSON, top level: benchmark, machine, tiny, output_len, history, selections, prefixes,
spec_width, fused_kernels, graphs, acceptance_rates, kv_cache_dtype, weights, load, sizing (per family and
context: pool_bytes, host_bytes, formula, the plan's figures with the hierarchy's sessions per
GPU with and without the MTP layer, prepare_s), engines (per engine: pool and fixed bytes,
layout), runs, skipped, speculation (per speculative run: eq. 13's predicted gain from the
measured sessions and from the plan's, beside the measured one, ``speculation.py``), noise (the
repeated C: first, second, relative difference), plots, elapsed_s, provenance. Each run: name, family, context, mode, spec, concurrency, repeat and
metrics, ``bench/serving/summary.py``'s names (sessions_admitted: peak running; mean_running;
output_tokens_per_s; decode_tokens_per_s; tpot_s, ttft_s, alloc_wait_s, prefill_s percentiles;
alloc_wait_share_of_ttft; reclaim {events, pages, repopulated_pages, admissions_waited};
repopulate_bytes_per_token; census {direct, hot, host}; host_read_bytes_per_token; spec;
acceptance_length; width_steps: the width chosen, by decode steps) and per_request_tokens_per_s
(1 / mean TPOT), imported (sessions seated from a prepared history), acceptance_control.

A history's copy into the host arena happens at admission: it counts in the allocation wait.

A preempted request admitted again imports its history again (as a cached prefix would give it
back). ``--history random`` is the source of rows and keys. ``--selections`` decides what decode
steps select: ``random``, the random histories' own top-k (the worst case for locality), or
``replay``, the shipped model's recorded selections (``--trace``, ``bench census --trace``)
mapped onto the served model's producers, top-k and context (``replay``: how, and what the
mapping keeps); the producers still run, so a step costs what it costs. ``sizing`` then
records the mapping (``replay``: trace, its context, expansion, spread, and the census a
session alone should show, ``predicted_census``, beside which each run's measured census
reads).

``python -m bench load-projection`` (``project_cli``, ``projection``) projects the full models
on 8 H200 from the roofline's per-region costs and the plan's sessions (its docstrings).

Modules: ``pool`` (the budget from the plan), ``history`` (prepared histories and their
import), ``engines`` (variants, one engine each), ``runs`` (a context's lockstep groups, eq. 13
and the noise), ``speculation`` (eq. 13), ``replay`` (replayed selections), ``cli`` (flags,
sizing, JSON), ``report`` (table, plots), ``projection`` and ``project_cli`` (the projection
to 8 GPUs)."""
