"""Argument checks shared by the launchers: every failure names the argument."""

import torch

from ._triton import interpreting
from .formats import QUANTISED_DTYPES, QUERY_DTYPES, is_quantised

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def next_power_of_2(n: int) -> int:
    """For launchers (host code): Triton's own is a constexpr function, some microseconds a call
    on the host, and the launchers run for every layer of every step."""
    return 1 << max(int(n) - 1, 0).bit_length()


class KernelArgumentError(ValueError):
    """A kernel argument has the wrong shape, dtype, stride or device; the message names it."""


def check(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise KernelArgumentError(f"{name}: {message}")


def check_window(window: int | None) -> None:
    """A sliding window is a positive number of tokens, or None for full attention."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        check(False, "window", f"must be a positive number of tokens or None, got {window!r}")


def check_softcap(softcap: float | None) -> None:
    """A score cap (Gemma 2's attn_logit_softcapping) is a positive finite number, or None for none."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap > 0 or softcap == float("inf")):
        check(False, "softcap", f"must be a positive number or None, got {softcap!r}")


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """Attention sinks (gpt-oss): one float32 logit per query head on the query's device, or None."""
    if sinks is None:
        return
    check_tensor("sinks", sinks, ndim=1, dtypes=(torch.float32,))
    if sinks.shape[0] != num_heads:
        check(False, "sinks", f"expected shape ({num_heads},), one per query head, got {tuple(sinks.shape)}")
    if sinks.device != device:
        check(False, "sinks", f"on {sinks.device}, expected {device} like q")


def check_tensor(name: str, t: torch.Tensor, *, ndim: int, dtypes: tuple[torch.dtype, ...],
                 contiguous: bool = True) -> None:
    # The messages are built only on failure: these checks run for every layer of every step.
    if not isinstance(t, torch.Tensor):
        check(False, name, f"expected a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        check(False, name, f"expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        check(False, name, f"expected dtype {' or '.join(str(d).replace('torch.', '') for d in dtypes)}, got "
                           f"{str(t.dtype).replace('torch.', '')}")
    if contiguous and not t.is_contiguous():
        check(False, name, f"must be contiguous, got strides {t.stride()}")


FP8_E4M3_MIN_CAPABILITY = (8, 9)  # Triton's fp8e4nv: Ada and Hopper on; A100 (8.0) has only e5m2


def format_unsupported(dtype: torch.dtype, capability: tuple[int, int]) -> str | None:
    """Why tensors of `dtype` cannot go through the kernels on a GPU of this compute
    capability, or None when they can (`python -m kvctl.kernels.compile_check --arch sm_80`
    shows the compiler's refusal)."""
    if dtype == torch.float8_e4m3fn and tuple(capability) < FP8_E4M3_MIN_CAPABILITY:
        return (f"fp8_e4m3 needs a GPU of compute capability 8.9 or newer (L4, L40S, H100, H200); "
                f"this one is {capability[0]}.{capability[1]}: use fp8_e5m2 or int8")
    return None


def format_unsupported_on(device: str | torch.device, dtype: torch.dtype) -> str | None:
    """`format_unsupported` for the GPU `device` is (its compute capability); a CPU holds every
    format."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return format_unsupported(dtype, torch.cuda.get_device_capability(device))


def check_device(tensors: dict[str, torch.Tensor | None]) -> torch.device:
    """All tensors on one device, and a device (and formats) the Triton kernels can run on."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device = t.device
            if not (t.is_cuda or interpreting()):
                check(False, name, f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {t.device}; "
                                   "use the *_ref function on the CPU")
        elif t.device != device:
            check(False, name, f"on {t.device}, expected {device} like the other arguments")
        if t.dtype == torch.float8_e4m3fn:  # the one format that depends on the GPU
            problem = format_unsupported_on(t.device, t.dtype)
            check(problem is None, name, problem or "")
    assert device is not None
    return device


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; returns that shape."""
    all_dtypes = QUERY_DTYPES + QUANTISED_DTYPES
    check_tensor("k_cache", k_cache, ndim=4, dtypes=all_dtypes)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=all_dtypes)
    # Messages are built only on failure: these checks run for every layer of every step.
    if v_cache.shape != k_cache.shape:
        check(False, "v_cache", f"shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        check(False, "v_cache", f"dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size not in SUPPORTED_BLOCK_SIZES:
        check(False, "k_cache", f"block size {block_size} unsupported; use one of {SUPPORTED_BLOCK_SIZES}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        check(False, "k_cache", f"head_dim {head_dim} unsupported; use one of {SUPPORTED_HEAD_DIMS}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> bool:
    """Scales are required for quantised caches and refused otherwise; returns is-quantised."""
    quantised = is_quantised(k_cache.dtype)
    num_kv_heads = k_cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not quantised:
            if scale is not None:
                check(False, name, f"given for an unquantised {k_cache.dtype} cache")
            continue
        if scale is None:
            check(False, name, f"required for a {k_cache.dtype} cache (one float32 per KV head)")
        check_tensor(name, scale, ndim=1, dtypes=(torch.float32,))
        if scale.shape[0] != num_kv_heads:
            check(False, name, f"expected shape ({num_kv_heads},), one per KV head, got {tuple(scale.shape)}")
    return quantised


def check_query(q: torch.Tensor, num_kv_heads: int, head_dim: int, *, name: str = "q") -> int:
    """q [tokens or seqs, num_heads, head_dim]; returns the GQA group size."""
    check_tensor(name, q, ndim=3, dtypes=QUERY_DTYPES)
    if q.shape[2] != head_dim:
        check(False, name, f"head_dim {q.shape[2]} differs from the cache's {head_dim}")
    if q.shape[1] % num_kv_heads:
        check(False, name, f"{q.shape[1]} heads is not a multiple of the cache's {num_kv_heads} KV heads")
    return q.shape[1] // num_kv_heads


class CheckedOnce:
    """What a launcher derives from its arguments' shapes, dtypes, strides and devices alone (the
    checks above and its launch plan), kept by that metadata: the same for every layer of a
    step, so each layer after the first skips the checks. A call whose metadata differs is
    checked again; one that fails a check leaves nothing behind.

        plans = CheckedOnce()
        plan = plans.get((q, k_cache, ...), (max_context, launch), lambda: check_and_plan(...))
    """

    def __init__(self, kept: int = 256) -> None:
        self.entries: dict[tuple, object] = {}
        self.kept = kept  # distinct keys remembered; past it the memo starts over

    def get(self, tensors: tuple, extra: tuple, make):
        try:
            key = tuple(None if t is None else (t.shape, t.dtype, t.stride(), t.device) for t in tensors) + (
                extra, interpreting())
        except AttributeError:  # an argument is not a tensor: `make` checks it and says which
            return make()
        found = self.entries.get(key)
        if found is not None:
            return found
        made = make()
        if len(self.entries) >= self.kept:
            self.entries.clear()
        self.entries[key] = made
        return made
