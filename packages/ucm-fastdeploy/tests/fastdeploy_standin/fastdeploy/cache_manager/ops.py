"""CPU versions of FastDeploy's compiled cache ops, those on its storage path.

The caches FastDeploy's model runner makes on the GPU are CPU paddle tensors here: the test
puts them in ``DEVICE`` under FastDeploy's IPC names (``set_data_ipc``), and
``share_external_data_`` hands them to the cache transfer manager as the real op maps the
runner's memory.  Pinned host buffers are ctypes arrays; ``swap_cache_layout`` copies blocks
between the caches and such a buffer with the layout FastDeploy's ``_init_storage_buffer``
describes.  The GPU/CPU swap space is not on the storage path and is not stood in.
"""

import ctypes
import math

DEVICE = {}  # IPC name -> tensor
_HOST = {}  # pointer -> the ctypes array that owns the memory

# as on platforms without it: the manager's cache-clearing thread (RL) returns at once
unset_data_ipc = None


def set_device(device):
    pass


def memory_allocated():
    return 0


def set_data_ipc(tensor, name):
    DEVICE[name] = tensor


def share_external_data_(tensor, name, shape, flag):
    shared = DEVICE[name]
    if list(shared.shape) != list(shape):
        raise ValueError(f"{name} is {list(shared.shape)}, asked for {list(shape)}")
    return shared


def cuda_host_alloc(size):
    buf = (ctypes.c_ubyte * size)()
    ptr = ctypes.addressof(buf)
    _HOST[ptr] = buf
    return ptr


def cuda_host_free(ptr):
    _HOST.pop(ptr, None)


def swap_cache_all_layers(*args):
    raise NotImplementedError("the GPU/CPU swap space is not on the storage path")


def swap_cache_layout(
    cache_tensors, buffer_ptr, cache_shape, gpu_block_ids, cpu_block_ids, device, mode
):
    """Per-layer caches ``[blocks, heads, block_size, head_dim]`` <-> a host buffer laid out
    ``[block, layer, heads, block_size, head_dim]``; mode 0 caches to buffer, 1 the reverse."""
    layers = len(cache_tensors)
    for gpu_block, cpu_block in zip(gpu_block_ids, cpu_block_ids):
        for layer, tensor in enumerate(cache_tensors):
            nbytes = math.prod(tensor.shape[1:]) * tensor.element_size()
            cache = tensor.data_ptr() + gpu_block * nbytes
            host = buffer_ptr + (cpu_block * layers + layer) * nbytes
            src, dst = (cache, host) if mode == 0 else (host, cache)
            ctypes.memmove(dst, src, nbytes)
