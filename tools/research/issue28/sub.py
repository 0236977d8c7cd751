"""Minimal KV-events subscriber for vLLM 0.32 (zmq SUB + msgspec)."""
import sys, zmq, msgspec, json, time
from vllm.distributed.kv_events import KVEventBatch  # or copy the Struct defs
endpoint = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:5557"
out = sys.argv[2] if len(sys.argv) > 2 else None
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.connect(endpoint)
sub.setsockopt_string(zmq.SUBSCRIBE, "")  # topic "" = all
dec = msgspec.msgpack.Decoder(type=KVEventBatch)
f = open(out, "a") if out else sys.stdout
while True:
    topic, seq, payload = sub.recv_multipart()
    batch = dec.decode(payload)
    for ev in batch.events:
        d = {"seq": int.from_bytes(seq, "big"), "ts": batch.ts, "dp": batch.data_parallel_rank,
             "type": type(ev).__name__}
        d.update({k: (v.hex()[:16] if isinstance(v, bytes) else v) for k, v in msgspec.structs.asdict(ev).items()
                  if k in ("medium", "group_idx", "block_size")})
        if hasattr(ev, "block_hashes"):
            d["n"] = len(ev.block_hashes); d["h0"] = ev.block_hashes[0].hex()[:16] if isinstance(ev.block_hashes[0], bytes) else ev.block_hashes[0]
        print(json.dumps(d), file=f, flush=True)
