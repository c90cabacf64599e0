"""The KV hierarchy's parts (DESIGN §3), for modes ``hisparse`` and ``adaptive``:

- ``tail``: the newest rows of each request and source, in a ring;
- ``hot_cache``: B recently useful rows per request and source, exact LRU;
- ``resolver`` / ``resolver_kernel`` / ``resolver_triton``: selected positions to locations,
  misses read from the host (torch reference, the fused Triton kernel, its launch);
- ``read_order``: the order a step's host reads are issued in (a policy; exact in any order);
- ``host_backup`` / ``host_copy``: every committed row in the node's host arena, and the bulk
  copies between it and the device;
- ``staging``: where a verify round's overflow beyond the hot cache goes (eq. 11);
- ``device_store`` / ``geometry``: the one owner of the device state the parts share, and
  where each source's rows live in it;
- ``plan`` / ``prefill`` / ``selection``: where a forward pass's new rows go, and its
  selections resolved source by source (an index producer's followers beside it or inline:
  ``kv.config.FollowerPrefetch``);
- ``session`` / ``reporter`` / ``local_store`` / ``region_store``: what durable sessions add,
  and the host store as the worker sees it.

The serving mode built from these parts (with adaptive residency) is
``serving.hierarchy_payload``; what a finished pass leaves behind, ``serving.hierarchy_commit``."""
