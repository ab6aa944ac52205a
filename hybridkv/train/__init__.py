"""Training the built-in tiny models: offline data, training-only kernels, the resumable loop."""
