"""Micro-benchmarks behind `fastdecode bench ...` and bench/*.py (no gRPC in the pure ones)."""
