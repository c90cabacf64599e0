"""The three dhisparse services: gateway, worker and kv_host_store."""
