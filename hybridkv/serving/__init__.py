"""The evaluation side of serving: real `vllm serve` processes running the connector, driven and
measured from outside (`vllm-bench`, `arena run --engine vllm`). Nothing here is imported by vLLM;
what vLLM imports is `hybridkv.integrations.vllm`.

- `server.py`: a `vllm serve` process per configuration (no cache, vLLM's own prefix cache, the
  connector), its flags, start-up and shutdown.
- `traffic.py`: the request traffic `vllm-bench` sends (sessions of shared prefixes), not arena
  workloads, which are `hybridkv.eval.workloads`.
- `bench.py`: `hybridkv vllm-bench`; `arena.py`: the arena's samples answered by servers;
  `models.py`: the checkpoints the bench serves.
"""
