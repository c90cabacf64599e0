"""Builds the Grafana dashboards (JSON) that the Helm chart ships, from the panel lists below.

    python deploy/grafana/dashboards.py          # rewrite deploy/helm/dhisparse/dashboards/*.json
    python deploy/grafana/dashboards.py --check  # fail if the committed JSON is stale

The JSON files are the artifact (Grafana imports them, the chart's ConfigMap carries them);
this file is their source. Conventions (DESIGN §7, docs/deploy.md):
- metric names come from ``dhisparse/metrics.py``; counters are queried with ``_total``;
- quantiles are ``histogram_quantile(q, sum by (le) (rate(x_bucket[$__rate_interval])))``;
- ``$model`` filters every series that carries a ``model`` label;
- series that both the gateway and the workers export (running/waiting, TTFT, TPOT, e2e,
  tokens, finished requests) are told apart by the ``component`` label that the chart's
  ServiceMonitors (or your scrape config) attach: gateway, worker, kv-host-store;
- a panel over metrics that no service exports yet names the feature that will export them in
  ``dhisparse_requires``; tests/deploy/test_dashboards_prometheus.py skips exactly those panels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_json import RI, Dashboard, Panel, Row, Target, quantiles, render

OUT_DIR = Path(__file__).resolve().parents[1] / "helm" / "dhisparse" / "dashboards"

# Features whose metrics dhisparse/metrics.py names but no service exports yet, or only a
# configuration the live test does not start exports; a panel that needs one says so
# (Panel.requires), and the live test skips it.
FEATURES = {
    "data-parallel": "a worker spanning ranks with --data-parallel-attention (DESIGN §8)",
    "admission": "gateway admission against the capacity ledger (DESIGN §1)",
    "residency": "load-adaptive residency: reclaim and repopulation (DESIGN §4)",
    "hierarchy": "serving over the KV hierarchy: resolver and host reads (DESIGN §3)",
    "speculation": "speculative decoding over the hierarchy (DESIGN §5)",
}

M = 'model=~"$model"'
GW = f'component="gateway", {M}'
WK = f'component="worker", {M}'


# --- the dashboards --------------------------------------------------------------------------

OVERVIEW = Dashboard(
    uid="dhisparse-overview",
    title="dhisparse / Overview",
    description="Latency as clients see it (gateway), load and throughput.",
    rows=[
        Row(
            "Now",
            [
                Panel(
                    "Requests running",
                    "Requests producing tokens, at the gateways.",
                    [Target(f"sum(dhisparse:num_requests_running{{{GW}}})")],
                    kind="stat",
                    width=6,
                    height=4,
                ),
                Panel(
                    "Requests waiting",
                    "Requests with no token yet (queued, admitted but prefilling), at the gateways.",
                    [Target(f"sum(dhisparse:num_requests_waiting{{{GW}}})")],
                    kind="stat",
                    width=6,
                    height=4,
                ),
                Panel(
                    "Generation throughput",
                    "Tokens generated per second, all gateways.",
                    [Target(f"sum(rate(dhisparse:generation_tokens_total{{{GW}}}{RI}))")],
                    unit="short",
                    kind="stat",
                    width=6,
                    height=4,
                ),
                Panel(
                    "TTFT p99",
                    "99th percentile time to first token at the gateways.",
                    [
                        Target(
                            "histogram_quantile(0.99, sum by (le) (rate("
                            f"dhisparse:time_to_first_token_seconds_bucket{{{GW}}}{RI})))"
                        )
                    ],
                    unit="s",
                    kind="stat",
                    width=6,
                    height=4,
                ),
            ],
        ),
        Row(
            "Latency (gateway)",
            [
                Panel(
                    "Time to first token",
                    "Arrival at the gateway to the first token: includes allocation wait.",
                    quantiles("dhisparse:time_to_first_token_seconds", GW),
                    unit="s",
                    width=8,
                ),
                Panel(
                    "Time per output token",
                    "Time between consecutive output tokens.",
                    quantiles("dhisparse:time_per_output_token_seconds", GW),
                    unit="s",
                    width=8,
                ),
                Panel(
                    "End-to-end latency",
                    "Arrival at the gateway to the last token, finished requests.",
                    quantiles("dhisparse:e2e_request_latency_seconds", GW),
                    unit="s",
                    width=8,
                ),
            ],
        ),
        Row(
            "Load and throughput",
            [
                Panel(
                    "Running and waiting",
                    "Requests running/waiting at the gateways and in the workers' schedulers.",
                    [
                        Target(
                            f"sum by (component) (dhisparse:num_requests_running{{{M}}})",
                            "{{component}} running",
                        ),
                        Target(
                            f"sum by (component) (dhisparse:num_requests_waiting{{{M}}})",
                            "{{component}} waiting",
                        ),
                    ],
                ),
                Panel(
                    "Token throughput",
                    "Prompt and generated tokens per second, at the gateways.",
                    [
                        Target(f"sum(rate(dhisparse:prompt_tokens_total{{{GW}}}{RI}))", "prompt"),
                        Target(
                            f"sum(rate(dhisparse:generation_tokens_total{{{GW}}}{RI}))",
                            "generation",
                        ),
                    ],
                ),
                Panel(
                    "Finished requests",
                    "Requests finished per second, by finish reason.",
                    [
                        Target(
                            "sum by (finished_reason) "
                            f"(rate(dhisparse:request_success_total{{{GW}}}{RI}))",
                            "{{finished_reason}}",
                        )
                    ],
                    unit="reqps",
                    stack=True,
                ),
                Panel(
                    "Generation throughput per worker",
                    "Tokens generated per second by each worker.",
                    [
                        Target(
                            "sum by (instance) "
                            f"(rate(dhisparse:generation_tokens_total{{{WK}}}{RI}))",
                            "{{instance}}",
                        )
                    ],
                ),
            ],
        ),
        Row(
            "Engine latency (workers)",
            [
                Panel(
                    "Engine time to first token",
                    "Arrival at the worker to its first token: the gateway's TTFT less routing"
                    " and allocation wait.",
                    quantiles("dhisparse:time_to_first_token_seconds", WK),
                    unit="s",
                    width=8,
                ),
                Panel(
                    "Engine time per output token",
                    "Per-request mean time per output token after the first, in the workers.",
                    quantiles("dhisparse:time_per_output_token_seconds", WK),
                    unit="s",
                    width=8,
                ),
                Panel(
                    "Engine end-to-end latency",
                    "Arrival at the worker to finish.",
                    quantiles("dhisparse:e2e_request_latency_seconds", WK),
                    unit="s",
                    width=8,
                ),
            ],
        ),
        Row(
            "Decode passes (workers)",
            [
                Panel(
                    "Decode passes by path",
                    "Decode passes per second: replayed as a CUDA graph, captured (run eagerly,"
                    " then recorded: a capture costs several steps), or eager (a CPU, a key's"
                    " first sighting, speculative verify rounds). Captures that keep coming"
                    " mean batch shapes that keep changing.",
                    [
                        Target(
                            f"sum by (path) (rate(dhisparse:decode_passes_total{{{WK}}}{RI}))",
                            "{{path}}",
                        )
                    ],
                    unit="ops",
                    stack=True,
                    width=8,
                ),
                Panel(
                    "CUDA graphs held",
                    "Decode graphs each worker holds (at most 64, least recently used dropped).",
                    [Target(f"sum by (instance) (dhisparse:cuda_graphs{{{WK}}})", "{{instance}}")],
                    width=8,
                ),
                Panel(
                    "Engine time by phase",
                    "Share of each phase in the workers' engine time: scheduling (admissions,"
                    " prefix imports included), prefill passes, decode steps and verify rounds;"
                    " and, within those, prefix reuse's imports and the pages requests leave"
                    " behind. What is left of a second is the worker's loop between steps.",
                    [
                        Target(
                            f"sum by (phase) (rate(dhisparse:engine_seconds_total{{{WK}}}{RI}))",
                            "{{phase}}",
                        ),
                        Target(
                            f"sum by (op) (rate(dhisparse:prefix_cache_seconds_total{{{WK}}}{RI}))",
                            "prefix {{op}}",
                        ),
                    ],
                    unit="percentunit",
                    width=8,
                ),
                Panel(
                    "Garbage-collector pauses",
                    "Share of each worker's time the Python garbage collector held it, and the"
                    " longest single pause. A full collection stalls the decode step that sets"
                    " it off; workers freeze their start-up heap (--gc-freeze) so collections"
                    " skip it.",
                    [
                        Target(
                            f"sum by (instance) (rate(dhisparse:gc_pause_seconds_total{{{WK}}}{RI}))",
                            "{{instance}} share",
                        ),
                        Target(
                            f"max by (instance) (dhisparse:gc_pause_max_seconds{{{WK}}})",
                            "{{instance}} longest (s)",
                        ),
                    ],
                    width=8,
                ),
                Panel(
                    "Kernel builds while serving",
                    "Triton kernels each worker built (a launch that met a new specialization"
                    " first waits for its build) per second, and the share of the worker's time"
                    " those launches waited. After start-up and the first requests of each"
                    " shape both stay at zero.",
                    [
                        Target(
                            f"sum by (instance) (rate(dhisparse:kernel_builds_total{{{WK}}}{RI}))",
                            "{{instance}} builds/s",
                        ),
                        Target(
                            "sum by (instance) "
                            f"(rate(dhisparse:kernel_build_seconds_total{{{WK}}}{RI}))",
                            "{{instance}} share waiting",
                        ),
                    ],
                    width=8,
                ),
                Panel(
                    "Workers by configuration",
                    "Workers per configuration they chose at start-up: device, serving mode,"
                    " CUDA graphs and why they are off (a CPU, a model with compressed or"
                    " windowed sources, --no-cuda-graphs), drafter.",
                    [
                        Target(
                            "count by (device, mode, cuda_graphs, graphs_off_reason, drafter)"
                            f" (dhisparse:worker_config_info{{{WK}}})",
                            "{{device}} {{mode}}, graphs {{cuda_graphs}} {{graphs_off_reason}},"
                            " drafter {{drafter}}",
                        )
                    ],
                    kind="stat",
                    width=24,
                    height=4,
                ),
            ],
        ),
        Row(
            "Data-parallel ranks (workers)",
            [
                Panel(
                    "Requests per data-parallel rank",
                    "Running and waiting requests on each rank of a worker serving with"
                    " --data-parallel-attention (each rank its own requests, hot caches and host"
                    " regions), as its rank 0 records them. Empty for one-rank and"
                    " tensor-parallel workers.",
                    [
                        Target(
                            f"sum by (instance, rank) (dhisparse:rank_requests_running{{{WK}}})",
                            "{{instance}} rank {{rank}} running",
                        ),
                        Target(
                            f"sum by (instance, rank) (dhisparse:rank_requests_waiting{{{WK}}})",
                            "{{instance}} rank {{rank}} waiting",
                        ),
                    ],
                    requires="data-parallel",
                ),
                Panel(
                    "Free KV pool per data-parallel rank",
                    "Each data-parallel rank's free KV pool bytes: the gateway admits each"
                    " request against one rank's share and names the rank, where rank 0 runs"
                    " it.",
                    [
                        Target(
                            f"sum by (instance, rank) (dhisparse:rank_kv_free_bytes{{{WK}}})",
                            "{{instance}} rank {{rank}}",
                        )
                    ],
                    unit="bytes",
                    requires="data-parallel",
                ),
            ],
        ),
    ],
)

ADMISSION = Dashboard(
    uid="dhisparse-admission",
    title="dhisparse / Admission",
    description="Admission against the capacity ledger: allocation wait, queue, rejections, "
    "capacity per worker.",
    rows=[
        Row(
            "Wait and queue",
            [
                Panel(
                    "Allocation wait",
                    "Time a request waited in the gateway's queue for GPU capacity.",
                    quantiles("dhisparse:allocation_wait_seconds", M),
                    unit="s",
                ),
                Panel(
                    "Admission queue depth",
                    "Requests waiting for capacity, per gateway.",
                    [
                        Target(
                            f"sum by (instance) (dhisparse:admission_queue_depth{{{M}}})",
                            "{{instance}}",
                        )
                    ],
                ),
            ],
        ),
        Row(
            "Rejections",
            [
                Panel(
                    "429 rate",
                    "Requests refused with 429 (saturated), per second, by reason.",
                    [
                        Target(
                            "sum by (reason) (rate(dhisparse:requests_rejected_total"
                            f'{{status="429", {M}}}{RI}))',
                            "{{reason}}",
                        )
                    ],
                    unit="reqps",
                ),
                Panel(
                    "503 rate",
                    "Requests refused with 503 (queue deadline passed, no capacity), per second,"
                    " by reason.",
                    [
                        Target(
                            "sum by (reason) (rate(dhisparse:requests_rejected_total"
                            f'{{status="503", {M}}}{RI}))',
                            "{{reason}}",
                        )
                    ],
                    unit="reqps",
                ),
            ],
        ),
        Row(
            "Capacity per worker",
            [
                # Every gateway replica reports the same shared ledger: max, not sum.
                Panel(
                    "Free capacity",
                    "GPU bytes still admissible on each worker (ledger view).",
                    [
                        Target(
                            f"max by (worker) (dhisparse:free_capacity_bytes{{{M}}})",
                            "{{worker}}",
                        )
                    ],
                    unit="bytes",
                    width=8,
                ),
                Panel(
                    "Admitted sessions",
                    "Sessions admitted on each worker.",
                    [
                        Target(
                            f"max by (worker) (dhisparse:admitted_sessions{{{M}}})",
                            "{{worker}}",
                        )
                    ],
                    width=8,
                ),
                Panel(
                    "Admitted bytes",
                    "Required GPU bytes of the sessions admitted on each worker (eq. 3), and of"
                    " those the prefix pages live requests there share, counted once.",
                    [
                        Target(
                            f"max by (worker) (dhisparse:admitted_bytes{{{M}}})",
                            "{{worker}}",
                        ),
                        Target(
                            f"max by (worker) (dhisparse:admitted_shared_bytes{{{M}}})",
                            "{{worker}} shared",
                        ),
                    ],
                    unit="bytes",
                    width=8,
                ),
            ],
        ),
        Row(
            "Routing by prefix affinity",
            [
                Panel(
                    "Gateway prefix hit rate",
                    "Share of the prompt tokens served that the workers imported from a cached"
                    " prefix instead of computing (usage.prompt_tokens_details.cached_tokens),"
                    " at the gateways.",
                    [
                        Target(
                            f"sum(rate(dhisparse:prompt_tokens_cached_total{{{GW}}}{RI})) / "
                            f"sum(rate(dhisparse:prompt_tokens_total{{{GW}}}{RI}))",
                            "hit rate",
                        )
                    ],
                    unit="percentunit",
                    width=6,
                ),
                Panel(
                    "Routing decisions",
                    "Worker requests per second by why their worker was chosen: the longest"
                    " predicted prefix hit (affinity), no predicted hit anywhere (load), or a"
                    " longer predicted hit elsewhere lost to load or room (load-over-affinity).",
                    [
                        Target(
                            f"sum by (reason) (rate(dhisparse:routing_decisions_total{{{M}}}{RI}))",
                            "{{reason}}",
                        )
                    ],
                    unit="reqps",
                    stack=True,
                    width=6,
                ),
                Panel(
                    "Predicted and reported cached tokens",
                    "Prompt tokens per second the chosen workers' nodes were predicted to hold,"
                    " those the workers reported imported (a prediction well above the report"
                    " means the stores evicted what the gateway's index remembers), and of those"
                    " the ones whose device pages the workers share with other requests.",
                    [
                        Target(
                            "sum(rate("
                            f"dhisparse:prefix_affinity_predicted_tokens_total{{{M}}}{RI}))",
                            "predicted",
                        ),
                        Target(
                            f"sum(rate(dhisparse:prompt_tokens_cached_total{{{GW}}}{RI}))",
                            "reported",
                        ),
                        Target(
                            f"sum(rate(dhisparse:prompt_tokens_shared_total{{{GW}}}{RI}))",
                            "shared on the device",
                        ),
                    ],
                    width=6,
                ),
                Panel(
                    "Prefix-affinity index",
                    "Pages each gateway replica's index remembers (least recently recorded"
                    " forgotten past --prefix-affinity-index-pages).",
                    [
                        Target(
                            f"sum by (instance) (dhisparse:prefix_affinity_index_pages{{{GW}}})",
                            "{{instance}}",
                        )
                    ],
                    width=6,
                ),
                Panel(
                    "Shared affinity feed",
                    "Records per second of the replicas' shared affinity feed in the ledger's"
                    " Redis: appended by each replica (sent), the others' applied to its index"
                    " (applied), lost to a full queue or an unreachable Redis (dropped).",
                    [
                        Target(
                            "sum by (outcome) (rate("
                            f"dhisparse:prefix_affinity_feed_records_total{{{GW}}}{RI}))",
                            "{{outcome}}",
                        )
                    ],
                    width=6,
                ),
            ],
        ),
    ],
)

KV = Dashboard(
    uid="dhisparse-kv-hierarchy",
    title="dhisparse / KV hierarchy",
    description="KV pools by class (eq. 3), reclaim and repopulation (§4), the fused resolver's "
    "census and host reads (§3).",
    rows=[
        Row(
            "Pools",
            [
                Panel(
                    "KV pool bytes by class",
                    "Required, optional, reserve and free KV pool bytes, all workers.",
                    [
                        Target(
                            f"sum by (class) (dhisparse:kv_pool_bytes{{{M}}})",
                            "{{class}}",
                        )
                    ],
                    unit="bytes",
                    stack=True,
                ),
                Panel(
                    "Free KV pool per worker",
                    "Free KV pool bytes on each worker.",
                    [
                        Target(
                            f'sum by (instance) (dhisparse:kv_pool_bytes{{class="free", {M}}})',
                            "{{instance}}",
                        )
                    ],
                    unit="bytes",
                ),
                Panel(
                    "Prefill tokens computed",
                    "Prompt tokens whose KV the workers computed vs prompt tokens served: a"
                    " session resumed from host backups is not recomputed.",
                    [
                        Target(
                            f"sum(rate(dhisparse:prefill_tokens_computed_total{{{M}}}{RI}))",
                            "computed",
                        ),
                        Target(f"sum(rate(dhisparse:prompt_tokens_total{{{WK}}}{RI}))", "prompt"),
                    ],
                ),
                Panel(
                    "Sessions resumed and streams re-attached",
                    "Sessions a restarted worker took over from host backups (no prompt"
                    " recompute), and client streams the gateway re-attached to them or lost.",
                    [
                        Target(
                            f"sum(rate(dhisparse:sessions_resumed_total{{{M}}}{RI}))", "resumed"
                        ),
                        Target(
                            f"sum by (outcome) (rate(dhisparse:streams_resumed_total{{{M}}}{RI}))",
                            "streams {{outcome}}",
                        ),
                    ],
                    unit="ops",
                ),
                Panel(
                    "Streams adopted by a live peer",
                    "Streams whose worker died or drained mid-generation: adopted by a live peer"
                    " of its node, or left waiting for the restart (no peer had room), and the"
                    " streams waiting for a restart now.",
                    [
                        Target(
                            f"sum by (outcome) (rate(dhisparse:adoptions_total{{{M}}}{RI}))",
                            "{{outcome}}",
                        ),
                        Target(
                            f"sum(dhisparse:sessions_waiting_restart{{{M}}})", "waiting restart"
                        ),
                    ],
                    unit="ops",
                ),
                Panel(
                    "Adoption latency p50 / p99",
                    "From a stream's break (its worker died or drained) to the first response"
                    " of the peer that adopted it.",
                    [
                        Target(
                            f"histogram_quantile({q}, sum by (le) (rate("
                            f"dhisparse:adoption_latency_seconds_bucket{{{M}}}{RI})))",
                            f"p{round(q * 100)}",
                        )
                        for q in (0.5, 0.99)
                    ],
                    unit="s",
                ),
            ],
        ),
        Row(
            "Prefix reuse",
            [
                Panel(
                    "Prefix cache hit rate",
                    "Share of admissions that looked up a cached prefix and imported one"
                    " (a conversation's next turn computes only its new tokens).",
                    [
                        Target(
                            f"sum(rate(dhisparse:prefix_cache_hits_total{{{M}}}{RI})) / "
                            f"sum(rate(dhisparse:prefix_cache_queries_total{{{M}}}{RI}))",
                            "hit rate",
                        )
                    ],
                    unit="percentunit",
                    width=8,
                ),
                Panel(
                    "Prompt tokens imported and computed",
                    "Prompt tokens imported from cached prefixes (host rows, no compute) and"
                    " prompt tokens whose KV was computed, per second.",
                    [
                        Target(
                            f"sum(rate(dhisparse:prefix_cache_hit_tokens_total{{{M}}}{RI}))",
                            "imported",
                        ),
                        Target(
                            f"sum(rate(dhisparse:prefill_tokens_computed_total{{{M}}}{RI}))",
                            "computed",
                        ),
                    ],
                    width=8,
                ),
                Panel(
                    "Pages left behind",
                    "Requests that left their complete pages in the host store as a cached"
                    " prefix, those the store could not hold (full of live rows, or down), and"
                    " running requests whose computed prompt was kept early for waiting ones.",
                    [
                        Target(
                            "sum by (outcome) (rate("
                            f"dhisparse:prefix_cache_left_total{{{M}}}{RI}))",
                            "{{outcome}}",
                        )
                    ],
                    unit="ops",
                    width=8,
                ),
            ],
        ),
        Row(
            "Reclaim and repopulation",
            [
                Panel(
                    "Reclaim",
                    "Reclaim events and optional pages reclaimed per second (eq. 4).",
                    [
                        Target(f"sum(rate(dhisparse:reclaim_events_total{{{M}}}{RI}))", "events/s"),
                        Target(f"sum(rate(dhisparse:reclaim_pages_total{{{M}}}{RI}))", "pages/s"),
                    ],
                    width=8,
                ),
                Panel(
                    "Reclaim latency",
                    "Admission with a deficit to its pages being free.",
                    quantiles("dhisparse:reclaim_latency_seconds", M),
                    unit="s",
                    width=8,
                ),
                Panel(
                    "Pages repopulated",
                    "Optional history pages refilled per second.",
                    [Target(f"sum(rate(dhisparse:repopulated_pages_total{{{M}}}{RI}))", "pages/s")],
                    width=8,
                ),
            ],
        ),
        Row(
            "Resolver and host reads",
            [
                Panel(
                    "Resolver census",
                    "Selected rows per second resolved directly (tail, ready optional page), in"
                    " the hot cache, or read from host memory.",
                    [
                        Target(
                            f"sum by (path) (rate(dhisparse:resolver_rows_total{{{M}}}{RI}))",
                            "{{path}}",
                        )
                    ],
                    stack=True,
                    width=8,
                ),
                Panel(
                    "Resolver share",
                    "Share of selected rows by resolution path.",
                    [
                        Target(
                            f"sum by (path) (rate(dhisparse:resolver_rows_total{{{M}}}{RI}))"
                            " / ignoring (path) group_left "
                            f"sum(rate(dhisparse:resolver_rows_total{{{M}}}{RI}))",
                            "{{path}}",
                        )
                    ],
                    unit="percentunit",
                    width=8,
                ),
                Panel(
                    "Host bytes per token",
                    "Bytes read from host backups per generated token.",
                    [
                        Target(
                            f"sum(rate(dhisparse:host_read_bytes_total{{{M}}}{RI}))"
                            f" / sum(rate(dhisparse:generation_tokens_total{{{WK}}}{RI}))",
                            "bytes/token",
                        )
                    ],
                    unit="bytes",
                    width=8,
                ),
            ],
        ),
    ],
)

SPECULATION = Dashboard(
    uid="dhisparse-speculation",
    title="dhisparse / Speculative decoding",
    description="Drafts, acceptance and the verification width in use (§5).",
    rows=[
        Row(
            "Acceptance",
            [
                Panel(
                    "Acceptance length",
                    "Tokens emitted per verification round: 1 + accepted / drafts.",
                    [
                        Target(
                            "1 + sum(rate(dhisparse:spec_decode_num_accepted_tokens_total"
                            f"{{{M}}}{RI})) / sum(rate(dhisparse:spec_decode_num_drafts_total"
                            f"{{{M}}}{RI}))",
                            "acceptance length",
                        )
                    ],
                ),
                Panel(
                    "Acceptance rate",
                    "Accepted draft tokens / proposed draft tokens.",
                    [
                        Target(
                            "sum(rate(dhisparse:spec_decode_num_accepted_tokens_total"
                            f"{{{M}}}{RI})) / sum(rate("
                            f"dhisparse:spec_decode_num_draft_tokens_total{{{M}}}{RI}))",
                            "acceptance rate",
                        )
                    ],
                    unit="percentunit",
                ),
                Panel(
                    "Acceptance by position",
                    "Share of drafts whose proposal at each position was accepted.",
                    [
                        Target(
                            "sum by (position) (rate("
                            f"dhisparse:spec_decode_num_accepted_tokens_per_pos_total{{{M}}}{RI}))"
                            " / ignoring (position) group_left "
                            f"sum(rate(dhisparse:spec_decode_num_drafts_total{{{M}}}{RI}))",
                            "position {{position}}",
                        )
                    ],
                    unit="percentunit",
                ),
                Panel(
                    "Block width in use",
                    "Verification block width each worker uses now (narrows as load grows).",
                    [
                        Target(
                            f"max by (instance) (dhisparse:spec_decode_block_width{{{M}}})",
                            "{{instance}}",
                        )
                    ],
                ),
            ],
        ),
        Row(
            "Volume",
            [
                Panel(
                    "Drafts and tokens",
                    "Verification rounds, proposed and accepted draft tokens per second.",
                    [
                        Target(
                            f"sum(rate(dhisparse:spec_decode_num_drafts_total{{{M}}}{RI}))",
                            "drafts",
                        ),
                        Target(
                            f"sum(rate(dhisparse:spec_decode_num_draft_tokens_total{{{M}}}{RI}))",
                            "draft tokens",
                        ),
                        Target(
                            "sum(rate(dhisparse:spec_decode_num_accepted_tokens_total"
                            f"{{{M}}}{RI}))",
                            "accepted tokens",
                        ),
                    ],
                    width=24,
                ),
            ],
        ),
    ],
)

INST = 'instance=~"$instance"'
HOST_STORE = Dashboard(
    uid="dhisparse-host-store",
    title="dhisparse / Host KV store",
    description="Each node's host arena (pinned host backups): bytes used and capacity.",
    model_var=False,
    instance_var="dhisparse:host_store_capacity_bytes",
    rows=[
        Row(
            "Arena",
            [
                Panel(
                    "Bytes used and capacity",
                    "Arena bytes held by live regions, and the arena size, per store.",
                    [
                        Target(
                            f"sum by (instance) (dhisparse:host_store_used_bytes{{{INST}}})",
                            "{{instance}} used",
                        ),
                        Target(
                            f"sum by (instance) (dhisparse:host_store_capacity_bytes{{{INST}}})",
                            "{{instance}} capacity",
                        ),
                    ],
                    unit="bytes",
                ),
                Panel(
                    "Arena used",
                    "Used / capacity per store.",
                    [
                        Target(
                            f"sum by (instance) (dhisparse:host_store_used_bytes{{{INST}}})"
                            " / sum by (instance) "
                            f"(dhisparse:host_store_capacity_bytes{{{INST}}})",
                            "{{instance}}",
                        )
                    ],
                    unit="percentunit",
                ),
                Panel(
                    "Durable bytes",
                    "Bytes of rows marked durable (complete host backups).",
                    [
                        Target(
                            f"sum by (instance) (dhisparse:host_store_durable_bytes{{{INST}}})",
                            "{{instance}}",
                        )
                    ],
                    unit="bytes",
                ),
                Panel(
                    "Regions and requests",
                    "Live regions and the requests holding them.",
                    [
                        Target(
                            f"sum by (instance) (dhisparse:host_store_regions{{{INST}}})",
                            "{{instance}} regions",
                        ),
                        Target(
                            f"sum by (instance) (dhisparse:host_store_requests{{{INST}}})",
                            "{{instance}} requests",
                        ),
                    ],
                ),
                Panel(
                    "Refused allocations",
                    "Allocations refused per second because no contiguous range fit.",
                    [
                        Target(
                            "sum by (instance) (rate("
                            f"dhisparse:host_store_allocations_refused_total{{{INST}}}{RI}))",
                            "{{instance}}",
                        )
                    ],
                    unit="ops",
                    width=24,
                ),
            ],
        ),
        Row(
            "Cached prefixes",
            [
                Panel(
                    "Cached prefix bytes",
                    "Arena bytes held by cached prefixes the store owns (evicted"
                    " least-recently-used when an allocation needs the room).",
                    [
                        Target(
                            f"sum by (instance) (dhisparse:host_store_prefix_bytes{{{INST}}})",
                            "{{instance}}",
                        )
                    ],
                    unit="bytes",
                    width=8,
                ),
                Panel(
                    "Cached prefixes",
                    "Cached prefixes each store holds.",
                    [
                        Target(
                            f"sum by (instance) (dhisparse:host_store_prefix_records{{{INST}}})",
                            "{{instance}}",
                        )
                    ],
                    width=8,
                ),
                Panel(
                    "Prefix evictions",
                    "Cached prefixes evicted per second to make room for an allocation.",
                    [
                        Target(
                            "sum by (instance) (rate("
                            f"dhisparse:host_store_prefix_evictions_total{{{INST}}}{RI}))",
                            "{{instance}}",
                        )
                    ],
                    unit="ops",
                    width=8,
                ),
            ],
        ),
        Row(
            "Owners and adoption",
            [
                Panel(
                    "Live owners",
                    "Worker processes registered with each store whose lease runs.",
                    [
                        Target(
                            f"sum by (instance) (dhisparse:host_store_owners{{{INST}}})",
                            "{{instance}}",
                        )
                    ],
                ),
                Panel(
                    "Adoptions and expired orphans",
                    "Requests of dead or draining workers adopted by a successor or a peer, those"
                    " freed because nobody adopted them within the orphan TTL, worker generations"
                    " a peer fenced off, and requests handed over, per second.",
                    [
                        Target(
                            "sum by (instance) (rate("
                            f"dhisparse:host_store_adoptions_total{{{INST}}}{RI}))",
                            "{{instance}} adopted",
                        ),
                        Target(
                            "sum by (instance) (rate("
                            f"dhisparse:host_store_orphans_expired_total{{{INST}}}{RI}))",
                            "{{instance}} expired",
                        ),
                        Target(
                            "sum by (instance) (rate("
                            f"dhisparse:host_store_owners_fenced_total{{{INST}}}{RI}))",
                            "{{instance}} owners fenced",
                        ),
                        Target(
                            "sum by (instance) (rate("
                            f"dhisparse:host_store_handovers_total{{{INST}}}{RI}))",
                            "{{instance}} handed over",
                        ),
                    ],
                    unit="ops",
                ),
            ],
        ),
    ],
)

DASHBOARDS = {
    "dhisparse-overview.json": OVERVIEW,
    "dhisparse-admission.json": ADMISSION,
    "dhisparse-kv-hierarchy.json": KV,
    "dhisparse-speculation.json": SPECULATION,
    "dhisparse-host-store.json": HOST_STORE,
}


def rendered() -> dict[str, str]:
    return {
        name: json.dumps(render(d, FEATURES), indent=2) + "\n" for name, d in DASHBOARDS.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    args = ap.parse_args(argv)
    want = rendered()
    stale = sorted(
        name
        for name, text in want.items()
        if not (OUT_DIR / name).exists() or (OUT_DIR / name).read_text() != text
    )
    extra = sorted(p.name for p in OUT_DIR.glob("*.json") if p.name not in want)
    if args.check:
        for name in stale:
            print(f"stale: {OUT_DIR / name} (run python deploy/grafana/dashboards.py)")
        for name in extra:
            print(f"not generated here: {OUT_DIR / name}")
        return 1 if stale or extra else 0
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name in stale:
        (OUT_DIR / name).write_text(want[name])
        print(f"wrote {OUT_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
