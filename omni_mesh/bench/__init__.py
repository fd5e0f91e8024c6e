"""Benchmarks: connector throughput against the raw transports they are built on."""
