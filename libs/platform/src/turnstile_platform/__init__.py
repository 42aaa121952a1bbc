"""Shared service platform: settings, gRPC bootstrap, rich errors, tracing, metrics,
logs, Redis connections and scripts. One place per concern."""
