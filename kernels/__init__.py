"""Triton kernels for the paged KV cache, each beside a plain-torch reference.

This package imports nothing of the rest of the project. The kernels land with
the kernels issue; until then it is empty so the layout and import rules hold.
"""
