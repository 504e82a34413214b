"""Shared helpers: small managers with a test-controlled clock."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The repository root must not be on sys.path (`python -m pytest` puts it there): its folders kernels/,
# daemon/ and policies/ would shadow published packages of those names (transformers imports `kernels`).
# The project imports as kvctl.* from its install; pytest's importlib mode needs no root on the path.
_REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _REPO]

try:  # Triton kernels run on the CPU interpreter unless a GPU is present (decided before import)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - the cache core needs no torch
    torch = None

from kvctl.daemon.cache import KVCacheManager, Namespace


class FakeClock:
    """A clock the test moves by hand; policies and pins read only this."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_manager(num_blocks: int = 10, block_size: int = 4, policy: str = "lru",
                 clock: FakeClock | None = None, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, policy=policy, clock=clock, **kwargs)


def run_prompt(manager: KVCacheManager, seq_id: str, tokens: list[int], *, reserve: int = 0,
               namespace: Namespace | None = None, priority: int = 0):
    """Admit a prompt and write all of it (prefill), as an engine would."""
    ns = namespace or Namespace(block_size=manager.block_size)
    admission = manager.admit_tokens(seq_id, ns, tokens, reserve, priority)
    manager.append(seq_id, len(tokens) - admission.hit_tokens)
    return admission
