"""Triton, when installed. Without it the references still work and launchers say why they cannot run."""

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    HAS_TRITON = False

    class _Unavailable:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError("Triton is not installed: use the *_ref functions, "
                               "or pip install 'kvctl[model]'")

    class _TritonStub:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return _Unavailable(fn) if fn is not None else _Unavailable

        @staticmethod
        def cdiv(a, b):
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n):
            return 1 << max(int(n) - 1, 0).bit_length()

    class _TLStub:
        constexpr = object

    triton = _TritonStub()
    tl = _TLStub()


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1: kernels run on the CPU, one program at a time."""
    return os.environ.get("TRITON_INTERPRET") == "1"
