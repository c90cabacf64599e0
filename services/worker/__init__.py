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
    width policy        services/worker/speculative/width_policy.py (run: width_controller.py)
    verification        services/worker/speculative/verify.py
    manifest            services/worker/durable/manifest.py

Packages, bottom to top (every import points down: ``tests/house/test_floors.py``):
``request`` (requests, sampling, stop strings), ``ops`` (kernels, each with a torch reference),
``parallel`` (collectives and shares of a model split over ranks), ``kv`` (the KV contract:
the payload protocol, pools, index keys, settings), ``hierarchy`` (the hierarchy's parts),
``residency`` (adaptive residency), ``serving`` (the serving modes), ``model`` (the model as
torch modules), ``weights`` (checkpoints in and out), ``verify`` (a checkpoint against
transformers), ``durable`` (sessions that survive their worker), ``graphs`` (CUDA graphs),
``speculative`` (speculative decoding), ``rank_group`` (a worker over several ranks),
``engine`` (scheduling and stepping); then the front: ``async_engine``, ``server``,
``settings``, ``metrics``, ``group`` (the launcher of a rank group), the CLIs."""
