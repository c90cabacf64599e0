"""Closed-loop serving benchmark (issue 11): resident / hisparse / adaptive × speculation off /
DFlash / DSpark / DFlash2 × width schedule fixed / paper / online, against concurrency.

    python -m bench serving --out docs/results/serving.json --plot docs/results/serving \
        --table docs/results/serving.md            # the default matrix
    python -m bench serving --device cpu --model tiny-glm --drafter-dir random \
        --input-lens 256 --output-len 8 --concurrency 1,3 --spec-concurrency 3 \
        --requests-per-client 2 --page-size 16 --resident-sessions 2     # a CPU smoke run

Each of C clients keeps exactly one request in flight and submits its next as soon as one
finishes (closed loop), either ``--requests-per-client`` times, or for ``--warmup-s`` +
``--duration-s`` seconds (metrics over the last ``--duration-s``; requests still in flight
then are aborted). Prompts are drawn from ``--prefixes`` prepared prefixes of each of
``--input-lens`` tokens (text of the Python standard library in the model's tokenizer); each
request asks for ``--output-len`` tokens with EOS ignored, greedily or, at ``--temperature
1``, sampled with a per-request seed. The KV budget holds ``--resident-sessions`` sessions of
the longest input in resident serving; each hierarchy engine gets that budget plus its own
fixed allocations (the capacity benchmark's rule); every mode gets the same slots, by default the
sessions the hierarchy can hold in the budget. Hierarchy engines share one host store and keep
durable sessions, as workers attached to a node's kv-host-store do (``--no-durable-sessions``
turns that off).

Engine level (default): one in-process ``Engine`` per (mode, drafter, schedule), driven by
``add_request`` + ``step()``. ``--http``: one real stack per engine key (kv-host-store, worker
and gateway processes on loopback), C httpx clients streaming ``/v1/completions``.

Default matrix (a subset, sized for one device command): speculation off in every mode at every
C of ``--concurrency`` (21 runs); each drafter x schedule only in ``--spec-modes`` (adaptive) at
``--spec-concurrency`` (4, 64: 18 runs). ``--full`` runs every combination. A run that would
end past ``--time-limit-s`` (420 s after start) is skipped and listed; the JSON is rewritten
after every run.

Output JSON, top level: benchmark, level (engine | http), machine, elapsed_s, model ({spec,
name, dtype, parameters, config}), matrix (the flags that chose the runs), drafter_dir,
spec_width, load (output_len, temperature, requests_per_client, duration_s, warmup_s, seed),
prompts, sizing (KV budget,
slots, page size, hot cache, host arena, ...), engines (per engine: pool_bytes, fixed_bytes,
drafter_source, durable_sessions, ...), runs, skipped, unavailable (what the engine does not
expose, and why), definitions and provenance (``bench/core/provenance.py``). Each run:
name, engine, run (mode, drafter, schedule, concurrency, input_len) and metrics:
  window_s; requests {issued, completed, completed_in_window, exact_length, errors,
  in_flight_at_end, never_admitted}; output_tokens_per_s (tokens emitted in the window);
  requests_per_s; sessions_admitted (most requests running at once); mean_running;
  ttft_s, alloc_wait_s (arrival to admission), prefill_s (admission to first token), each
  {mean, p50, p90, p99, max, n} over the requests whose first token came in the window;
  alloc_wait_share_of_ttft; oldest_unadmitted_wait_s (waits still open at the end);
  tpot_s (per request: mean time per token after the first, over requests whose latest token
  came in the window, finished or not); e2e_s (requests finished in the window);
  decode_steps, decode_step_s_mean, decode_tokens_per_s, decode_step_by_batch
  ({batch: [steps, seconds, tokens]}), decode_step_fit ({fixed_s, per_request_s}: decode step
  time against decode batch, what ``python -m bench projection`` scales); census {direct, hot, host,
  rows, rows_copied} (shares of selected rows; None in resident serving);
  host_read_bytes_per_token; repopulate_bytes_per_token; reclaim {events, pages,
  repopulated_pages, admissions_waited} (adaptive); reclaim_latency_s; optional_bytes_peak;
  spec {drafts, draft_tokens, accepted}; acceptance_length (1 + accepted/drafts);
  width_steps ({width: decode steps}). HTTP runs report the same names where the stack exposes
  them (see ``unavailable``).

Modules (``python -m bench serving`` runs ``cli``; ``python -m bench projection`` uses
``scaling``):

- ``config``: the run matrix and the closed-loop load;
- ``setup``: target model, drafters, prepared prompt prefixes, KV sizing;
- ``engines`` + ``loop``: the engine-level closed loop over an in-process ``Engine``;
- ``stack`` + ``http_loop``: the same loop over HTTP against the real stack;
- ``run``: a matrix at either level under a time limit; ``cli``: flags and the output JSON;
- ``summary``: a run's metrics; ``report``: markdown table and plots;
- ``scaling``: the projection's per-step bytes, FLOPs and binding resource (pure Python).
"""
