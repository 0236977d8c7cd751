"""The engine side of the cache transfer manager's IPC: signals as the engine left them
when the model runner had created the caches, and a task queue that records what the
manager reports done.  One rank, so every barrier passes at once."""

from enum import IntEnum

import numpy as np


class KVCacheStatus(IntEnum):
    NORMAL = 0
    CLEARING = 1
    CLEARED = 2
    UPDATING = 3


class IPCSignal:
    def __init__(self, name, array, dtype, suffix=None, create=False):
        self.name = name
        self.value = np.array(array, dtype=dtype)
        if name == "cache_ready_signal":  # the runner has created the caches
            self.value[:] = 1


class _Barrier:
    def wait(self):
        pass

    def reset(self):
        pass


class EngineCacheQueue:
    def __init__(self, address, is_server, num_client, client_id, local_data_parallel_id):
        self.done = []  # what put_transfer_done_signal reported, in order

    def __getattr__(self, name):
        if "barrier" in name:
            return _Barrier()
        raise AttributeError(name)

    def put_transfer_done_signal(self, result):
        self.done.append(result)

    def empty(self):
        return True
