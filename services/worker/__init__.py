"""The GPU worker: model, engine, KV hierarchy, kernels and the gRPC front."""
