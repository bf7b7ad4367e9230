"""Plumbing shared by the services: codec, conversions, errors, gRPC, settings, logs, metrics,
process lifecycle, the fleet secret. Cores use errors, settings and geometry; only adapters use gRPC."""
