"""Megatron's .bin/.idx datasets, their index caches, and data on object storage (docs/object-storage.md)."""
