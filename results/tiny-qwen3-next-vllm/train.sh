#!/bin/bash
# resumable: run again to go on
cd /work/main
exec .venv/bin/hybridkv train /work/runs/vllm1 --model tiny-qwen3-next \
  --shape '{"linear_key_head_dim": 64, "linear_value_head_dim": 64, "rms_norm_eps": 2.5e-07}' \
  --init /work/runs/widened --schedule 1024:80,2048:200,4096:250 --tokens-per-step 8192 --lr 1e-3 \
  --tasks niah:0.4,recall:0.2,vt:0.1,natural:0.15,copy:0.05,passages:0.05,pairs:0.05 \
  --eval-every 100 --threads 1
