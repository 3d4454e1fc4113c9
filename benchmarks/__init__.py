"""Benchmarks: time and peak memory to a sharded model, the builder against plain PyTorch.

``fsdp-builder bench`` runs :func:`benchmarks.harness.main`.
"""
