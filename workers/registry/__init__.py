"""The registry: the gRPC service node agents and guests call into corral."""
