"""Adapters that put hybridkv inside serving engines."""
