"""pcvr_lib: what pcvr-bench measures (data conversion, GPU kernels, optimizers, PCVR models)."""

__version__ = "0.1.0"
