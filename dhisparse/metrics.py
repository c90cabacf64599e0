"""Metric names and buckets: part of the interface (DESIGN §7). Every service builds its
metrics from here so dashboards, alerts and tests have one source of truth."""

from __future__ import annotations

PREFIX = "dhisparse:"

# vLLM-style histogram buckets.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# Allocation wait spans "admitted at once" to "waited for a slot for minutes".
ALLOC_WAIT_BUCKETS = (
    0.0005,
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
RECLAIM_LATENCY_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)

# --- shared by gateway and worker -------------------------------------------------------------
NUM_REQUESTS_RUNNING = PREFIX + "num_requests_running"
NUM_REQUESTS_WAITING = PREFIX + "num_requests_waiting"
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN = PREFIX + "time_per_output_token_seconds"
E2E_REQUEST_LATENCY = PREFIX + "e2e_request_latency_seconds"
PROMPT_TOKENS = PREFIX + "prompt_tokens"  # counter (exported with _total)
GENERATION_TOKENS = PREFIX + "generation_tokens"  # counter
REQUEST_SUCCESS = PREFIX + "request_success"  # counter{finished_reason}

# --- gateway: admission ---------------------------------------------------------------------
ALLOCATION_WAIT = PREFIX + "allocation_wait_seconds"
QUEUE_DEPTH = PREFIX + "admission_queue_depth"
REQUESTS_REJECTED = PREFIX + "requests_rejected"  # counter{reason,status}
ADMITTED_SESSIONS = PREFIX + "admitted_sessions"  # gauge{worker}
ADMITTED_BYTES = PREFIX + "admitted_bytes"  # gauge{worker}
# of those, the pages live requests share on the worker, counted once (services/gateway/ledger.py)
ADMITTED_SHARED_BYTES = PREFIX + "admitted_shared_bytes"  # gauge{worker}
FREE_CAPACITY_BYTES = PREFIX + "free_capacity_bytes"  # gauge{worker}
STREAMS_RESUMED = PREFIX + "streams_resumed"  # counter{outcome}: worker died mid-stream
# a stream whose worker died or drained, moved to a live peer of its node (DESIGN §10)
ADOPTIONS = PREFIX + "adoptions"  # counter{outcome=adopted|no_peer}
ADOPTION_LATENCY = PREFIX + "adoption_latency_seconds"  # histogram: break to the peer's first
SESSIONS_WAITING_RESTART = PREFIX + "sessions_waiting_restart"  # gauge: no peer held them

# --- gateway: prefix-affinity routing (services/gateway/affinity.py) ---------------------------
# admitted worker requests by why their worker was chosen: affinity | load | load-over-affinity
ROUTING_DECISIONS = PREFIX + "routing_decisions"  # counter{reason}
# prompt tokens the chosen workers' nodes were predicted to hold
PREFIX_AFFINITY_PREDICTED_TOKENS = PREFIX + "prefix_affinity_predicted_tokens"  # counter
PREFIX_AFFINITY_INDEX_PAGES = PREFIX + "prefix_affinity_index_pages"  # gauge: pages it remembers
# records of the replicas' shared feed (services/gateway/affinity_feed.py): this replica's
# appended (sent), the others' applied, and records lost (dropped: a full queue, Redis down)
PREFIX_AFFINITY_FEED_RECORDS = PREFIX + "prefix_affinity_feed_records"  # counter{outcome}
# prompt tokens the workers reported not computing (usage.prompt_tokens_details.cached_tokens);
# the hit rate is its rate over prompt_tokens'
PROMPT_TOKENS_CACHED = PREFIX + "prompt_tokens_cached"  # counter
# of those, the tokens whose device pages the workers share with other requests
PROMPT_TOKENS_SHARED = PREFIX + "prompt_tokens_shared"  # counter

# --- worker: KV hierarchy ---------------------------------------------------------------------
KV_POOL_BYTES = PREFIX + "kv_pool_bytes"  # gauge{class=required|optional|reserve|free}
RECLAIM_EVENTS = PREFIX + "reclaim_events"  # counter
RECLAIM_PAGES = PREFIX + "reclaim_pages"  # counter
RECLAIM_LATENCY = PREFIX + "reclaim_latency_seconds"  # histogram
REPOPULATED_PAGES = PREFIX + "repopulated_pages"  # counter
RESOLVER_ROWS = PREFIX + "resolver_rows"  # counter{path=direct|hot|host}
HOST_READ_BYTES = PREFIX + "host_read_bytes"  # counter; per token = rate / generation_tokens rate
PREFILL_TOKENS_COMPUTED = PREFIX + "prefill_tokens_computed"  # counter (resume = no recompute)
SESSIONS_RESUMED = PREFIX + "sessions_resumed"  # counter: adopted from a dead worker, continued
# prefix reuse (services/worker/serving/prefix_reuse.py): admissions that looked up a cached
# prefix, those that imported one, and the prompt tokens imported instead of computed
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries"  # counter
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits"  # counter
PREFIX_CACHE_HIT_TOKENS = PREFIX + "prefix_cache_hit_tokens"  # counter
# requests whose pages were handed to the store as a cached prefix, or could not be
# counter{outcome=cached|refused|published}: requests that left their pages at their end, or
# could not; running requests whose computed prompt was kept early for waiting ones
PREFIX_CACHE_LEFT = PREFIX + "prefix_cache_left"

# --- worker: the ranks of a data-parallel-attention group (each its own requests and KV) ------
RANK_REQUESTS_RUNNING = PREFIX + "rank_requests_running"  # gauge{rank}
RANK_REQUESTS_WAITING = PREFIX + "rank_requests_waiting"  # gauge{rank}
RANK_KV_FREE_BYTES = PREFIX + "rank_kv_free_bytes"  # gauge{rank}: its pool's free bytes

# --- worker: configuration ---------------------------------------------------------------------
# gauge{device,mode,cuda_graphs,graphs_off_reason,graph_capture,drafter,durable_sessions}, always
# 1 (an info metric): what the worker chose at start-up
WORKER_CONFIG_INFO = PREFIX + "worker_config_info"

# --- worker: decode passes ---------------------------------------------------------------------
# counter{path=graph|capture|eager}: replayed CUDA graph, captured (runs eagerly, then records),
# or eager (no graph: a CPU, a key's first sighting, a model or verify round not captured)
DECODE_PASSES = PREFIX + "decode_passes"
CUDA_GRAPHS = PREFIX + "cuda_graphs"  # gauge: decode graphs held
# counter{phase=schedule|prefill|decode}: the engine's wall seconds by phase of its steps
# (schedule: admissions, prefix imports included; decode: decode steps and verify rounds)
ENGINE_SECONDS = PREFIX + "engine_seconds"
# counter{op=import|leave}: wall seconds in prefix reuse (within the engine's phases: imports
# while scheduling, leaving pages behind in the step that ends a request)
PREFIX_CACHE_SECONDS = PREFIX + "prefix_cache_seconds"
# counter{generation}: seconds the Python garbage collector stopped the worker process (a full
# collection can stall a decode step: services/worker/engine/heap.py)
GC_PAUSE_SECONDS = PREFIX + "gc_pause_seconds"
GC_PAUSE_MAX_SECONDS = PREFIX + "gc_pause_max_seconds"  # gauge: the longest one pause so far
# counter: Triton kernels the worker process built (a new specialization met first), and the
# seconds the launches that asked for them waited (services/worker/engine/kernel_builds.py)
KERNEL_BUILDS = PREFIX + "kernel_builds"
KERNEL_BUILD_SECONDS = PREFIX + "kernel_build_seconds"

# --- worker: speculative decoding (vLLM conventions) ----------------------------------------
SPEC_DRAFTS = PREFIX + "spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = PREFIX + "spec_decode_num_draft_tokens"
SPEC_ACCEPTED_TOKENS = PREFIX + "spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = PREFIX + "spec_decode_num_accepted_tokens_per_pos"  # {position}
SPEC_BLOCK_WIDTH = PREFIX + "spec_decode_block_width"  # gauge

# --- kv_host_store ----------------------------------------------------------------------------
HOST_STORE_USED_BYTES = PREFIX + "host_store_used_bytes"
HOST_STORE_CAPACITY_BYTES = PREFIX + "host_store_capacity_bytes"
HOST_STORE_DURABLE_BYTES = PREFIX + "host_store_durable_bytes"
HOST_STORE_REGIONS = PREFIX + "host_store_regions"
HOST_STORE_REQUESTS = PREFIX + "host_store_requests"
HOST_STORE_REFUSED = PREFIX + "host_store_allocations_refused"  # counter
HOST_STORE_OWNERS = PREFIX + "host_store_owners"  # gauge: worker processes with a live lease
HOST_STORE_ADOPTIONS = PREFIX + "host_store_adoptions"  # counter
HOST_STORE_OWNERS_FENCED = PREFIX + "host_store_owners_fenced"  # counter: by an adopting peer
HOST_STORE_HANDOVERS = PREFIX + "host_store_handovers"  # counter: offered to peers by their owner
HOST_STORE_ORPHANS_EXPIRED = PREFIX + "host_store_orphans_expired"  # counter
HOST_STORE_PREFIX_RECORDS = PREFIX + "host_store_prefix_records"  # gauge: cached prefixes
HOST_STORE_PREFIX_BYTES = PREFIX + "host_store_prefix_bytes"  # gauge: arena bytes they hold
HOST_STORE_PREFIX_EVICTIONS = PREFIX + "host_store_prefix_evictions"  # counter: for room
