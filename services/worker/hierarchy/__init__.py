"""The KV hierarchy (DESIGN §3): tail ring, hot cache, host backup and the resolver."""
