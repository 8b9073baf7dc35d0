"""Benchmarks: collectives (nccl-tests style), fused operators, tensor parallelism, heterogeneity."""
