"""The torch-free cache core: block pool, prefix keys, sequences, pins, audit."""

from .errors import (AuditFailure, CacheError, CacheFull, DuplicateSequence, InvalidRequest,
                     PinBudgetExceeded, PinLeavesNoRoom, UnknownPin, UnknownSequence)
from .keys import BlockKey, Namespace, PrefixHasher, block_key, chain_keys
from .manager import Admission, EvictionReport, KVCacheManager, PinResult
from .pins import Pin

__all__ = [
    "Admission", "AuditFailure", "BlockKey", "CacheError", "CacheFull", "DuplicateSequence",
    "EvictionReport", "InvalidRequest", "KVCacheManager", "Namespace", "Pin", "PinBudgetExceeded",
    "PinLeavesNoRoom", "PinResult", "PrefixHasher", "UnknownPin", "UnknownSequence", "block_key", "chain_keys",
]
