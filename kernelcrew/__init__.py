"""kernelcrew: verified, faster GPU kernels for PyTorch modules."""

__version__ = "0.1.0"
