"""Workloads, fidelity metrics and the runners that measure methods against full prefill."""
