"""The KV hierarchy (DESIGN §3), modes ``hisparse`` and ``adaptive``:

- ``tail``: the newest rows of each request and source, in a ring;
- ``hot_cache``: B recently useful rows per request and source, exact LRU;
- ``resolver`` / ``resolver_kernel`` / ``resolver_triton``: selected positions to locations,
  misses read from the host (torch reference, the fused Triton kernel, its launch);
- ``read_order``: the order a step's host reads are issued in (a policy; exact in any order);
- ``host_backup`` / ``host_copy``: every committed row in the node's host arena, and the bulk
  copies between it and the device;
- ``staging``: where a verify round's overflow beyond the hot cache goes (eq. 11);
- ``device_store``: the one owner of the device state the parts share;
- ``plan`` / ``selection`` / ``commit`` / ``payload``: one forward pass over the hierarchy;
- ``session`` / ``reporter`` / ``local_store`` / ``region_store``: what durable sessions add,
  and the host store as the worker sees it."""
