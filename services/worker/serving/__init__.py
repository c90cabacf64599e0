"""The serving modes (DESIGN §3): ``cache.KVCache`` holds a worker's KV state over one
payload — ``resident.ResidentPayload`` (mode ``resident``) or
``hierarchy_payload.HierarchyPayload`` (modes ``hisparse`` and ``adaptive``, built by
``hierarchy_build`` from the hierarchy's parts and adaptive residency)."""
