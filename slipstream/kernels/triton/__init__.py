"""Triton kernels for the GPU engine, one module per kernel family, each with a torch reference.

On a machine without a GPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`, set
before `triton` is imported), which is how the tests check them in CI against their references.
"""
