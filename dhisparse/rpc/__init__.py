"""Generated gRPC code (``make proto``); protobuf types stop at each service's server/convert modules."""
