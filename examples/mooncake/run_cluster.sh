#!/usr/bin/env bash
# A Mooncake cluster on this host: the master (metadata, port 50051) and a segment server
# (port 50052) giving the pool SIZE of this host's memory. Ctrl-C stops both.
#
#   examples/mooncake/run_cluster.sh ADDRESS [SIZE]
#
# ADDRESS  this host's address that the engines reach
# SIZE     memory for blocks, as Mooncake writes sizes: "64 GB" (default), "512 MB"
set -euo pipefail
ADDRESS=${1:?usage: run_cluster.sh ADDRESS [SIZE]}
SIZE=${2:-64 GB}
trap 'kill 0' EXIT
mooncake_master --rpc_address="$ADDRESS" --rpc_port=50051 \
    --enable_http_metadata_server=false &
sleep 1
mooncake_client --master_server_address="$ADDRESS:50051" --host="$ADDRESS" --port=50052 \
    --global_segment_size="$SIZE" --local_buffer_size="16 MB" \
    --metadata_server=P2PHANDSHAKE --protocol=tcp &
wait
