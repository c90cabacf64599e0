"""The GPU worker: model, engine, KV hierarchy, kernels and the gRPC front.

The paper's concepts, each where it is defined:

    tail                services/worker/hierarchy/tail.py
    hot cache           services/worker/hierarchy/hot_cache.py
    resolver            services/worker/hierarchy/resolver.py (reference),
                        resolver_kernel.py (the fused Triton kernel), resolver_triton.py
    host backup         services/worker/hierarchy/host_backup.py (copies: host_copy.py)
    staging             services/worker/hierarchy/staging.py
    device store        services/worker/hierarchy/device_store.py
    optional history    services/worker/residency/optional_history.py
    reclaim             services/worker/residency/reclaim.py (whom: residency/policy.py)
    repopulation        services/worker/residency/repopulation.py
    draft ring          services/worker/speculative/draft_ring.py
    drafters            services/worker/speculative/drafters/
    width policy        services/worker/speculative/width_policy.py
    verification        services/worker/speculative/verify.py
    manifest            services/worker/durable/manifest.py

Packages: ``model`` (the DSA family), ``ops`` (indexer and sparse attention, torch and Triton),
``kv`` (the serving modes' common state and the payload protocol), ``hierarchy`` (modes
``hisparse`` and ``adaptive``), ``residency`` (adaptive residency), ``speculative``
(speculative decoding), ``durable`` (sessions that survive their worker), ``engine``
(scheduling, sampling, CUDA graphs)."""
