"""GPU operators with explicit backends ("torch", "triton", "tilelang", "cuembed").

Each operator package (norms, attention, embedding_bag) has the same shape: `__init__` (the entry points,
their input checks and autograd Functions), `config` (tiles), `reference` (fp64), `triton_impl`,
`tilelang_impl`. `dispatch` knows which backend of which op can run here. Importing this package imports
no DSL: triton and tilelang load with the first launch of a backend that needs them.
"""

from pcvr_lib.kernels.attention import flash_attention, key_lengths_from_mask, role_mask
from pcvr_lib.kernels.embedding_bag import embedding_bag_mean
from pcvr_lib.kernels.norms import layer_norm, rms_norm

__all__ = ["embedding_bag_mean", "flash_attention", "key_lengths_from_mask", "layer_norm", "rms_norm", "role_mask"]
