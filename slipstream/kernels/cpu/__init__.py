"""Native CPU kernels: C sources compiled once per machine with the system compiler.

Triton has no CPU backend, and torch's packed int4/int8 CPU kernels either round activations to
bf16 or are slow at batch 1, so the operators of a CPU decode step are small C files here,
compiled on first use (about a second) into a per-machine cache and bound with ctypes.
`reference.py` holds the torch reference each kernel is tested against.
"""
from slipstream.kernels.cpu.build import load_library, native_available

__all__ = ["load_library", "native_available"]
