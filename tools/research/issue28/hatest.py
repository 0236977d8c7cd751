import os, sys, time, subprocess, signal
os.environ.setdefault("MC_STORE_CLUSTER_ID", os.environ.get("CID","ucm_ha_test"))
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
t = time.perf_counter()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", "etcd://127.0.0.1:23790")
print("setup rc", rc, f"{time.perf_counter()-t:.2f}s", flush=True)
val = b"x" * 4096
for i in range(5):
    print("put", i, s.put(f"k{i}", val), flush=True)
print("exist before", s.batch_is_exist([f"k{i}" for i in range(5)]), flush=True)
leader_pid = int(open("master1.pid").read())
t0 = time.time(); os.kill(leader_pid, signal.SIGKILL); print("killed leader at", t0, flush=True)
first_ok = None; errs = {}
deadline = time.time() + 60
i = 0
while time.time() < deadline:
    i += 1
    ts = time.perf_counter()
    r = s.put(f"n{i}", val)
    dt = time.perf_counter() - ts
    if r == 0 and first_ok is None:
        first_ok = time.time() - t0
        print(f"first put OK after {first_ok:.2f}s (call took {dt:.3f}s)", flush=True)
        break
    errs[r] = errs.get(r, 0) + 1
    time.sleep(0.05)
print("errors before success", errs, flush=True)
print("exist old keys after failover", s.batch_is_exist([f"k{i}" for i in range(5)]), flush=True)
g = s.get("k0"); print("get k0 len", len(g) if g is not None else None, flush=True)
print("exist new", s.batch_is_exist([f"n{i}"]), "get new len", len(s.get(f"n{i}")), flush=True)
lat = []
for j in range(50):
    ts = time.perf_counter(); s.put(f"m{j}", val); lat.append(time.perf_counter() - ts)
lat.sort(); print("put median ms after failover", round(lat[25]*1000, 2), flush=True)
os._exit(0)
