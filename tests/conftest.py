"""Root of the tests: puts this folder on sys.path (pytest's prepend mode), so `support` imports.

On a machine without a GPU every Triton kernel runs under Triton's interpreter, which must be
chosen before the first `import triton` of the session (collection imports test modules in order,
and any of them may import triton); tests that compile for a real GPU do so in a subprocess
without it."""
import os

if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch
        _cuda = torch.cuda.is_available()
    except ImportError:
        _cuda = False
    if not _cuda:
        os.environ["TRITON_INTERPRET"] = "1"
