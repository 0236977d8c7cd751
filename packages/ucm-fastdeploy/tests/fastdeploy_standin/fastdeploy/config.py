"""``SpeculativeConfig`` without speculative decoding: no extra cache layers."""


class SpeculativeConfig:
    def __init__(self, args):
        self.num_extra_cache_layer = 0
        self.num_gpu_block_expand_ratio = 1
