"""Copy and hash 1 GiB of blocks into one mapping, whole or in pieces, on one and two threads,
against one thread's memcpy: why the arena store hashes and copies each piece in one call
(python pieces.py; KIB=2048 for 2 MiB blocks; SHM=1 maps a file in /dev/shm as the store
does).  Kept as it ran on 2026-11-26."""
import mmap, time, numpy as np, xxhash, os
from concurrent.futures import ThreadPoolExecutor
size=int(os.environ.get("KIB","256"))<<10; n=(1<<30)//size
src=[mmap.mmap(-1,size) for _ in range(16)]
for s in src: s.write(os.urandom(size))
import os
if os.environ.get("SHM"):
    fd=os.open("/dev/shm/microarena",os.O_RDWR|os.O_CREAT,0o600); os.ftruncate(fd,n*size); arena=mmap.mmap(fd,n*size)
else: arena=mmap.mmap(-1,n*size)
np.frombuffer(arena,np.uint8)[:]=1
mv=memoryview(arena); srcv=[memoryview(s) for s in src]
def cp(d,s): np.copyto(np.frombuffer(d,np.uint8), np.frombuffer(s,np.uint8))
def a(i):
    d=mv[i*size:(i+1)*size]; cp(d,srcv[i%16]); return xxhash.xxh3_64_intdigest(d)
def b(i):
    d=mv[i*size:(i+1)*size]; s=srcv[i%16]; h=xxhash.xxh3_64_intdigest(s); cp(d,s); return h
def mk(chunk, srcfirst):
    def f(i):
        d=mv[i*size:(i+1)*size]; s=srcv[i%16]; h=xxhash.xxh3_64()
        for o in range(0,size,chunk):
            if srcfirst: h.update(s[o:o+chunk]); cp(d[o:o+chunk],s[o:o+chunk])
            else: cp(d[o:o+chunk],s[o:o+chunk]); h.update(d[o:o+chunk])
        return h.intdigest()
    return f
def memcpy(i): mv[i*size:(i+1)*size]=src[i%16]
pool=ThreadPoolExecutor(2)
def bench(f,th):
    best=9
    for r in range(3):
        t=time.perf_counter()
        def run(k):
            for i in range(k,n,th): f(i)
        list(pool.map(run,range(th)))
        best=min(best,time.perf_counter()-t)
    return n*size/best/1e9
base=bench(memcpy,1)
print("memcpy 1 thread", round(base,2))
for name,f in [("copy,hash dst",a),("hash src,copy",b),("64K copy>hash",mk(64<<10,False)),("64K hash>copy",mk(64<<10,True)),("128K hash>copy",mk(128<<10,True))]:
    print(f"{name:16s} 1th {bench(f,1)/base:.2f}  2th {bench(f,2)/base:.2f}")
