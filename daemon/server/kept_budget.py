"""A kept store's budget of bytes set anew by a reload (`responses_store_bytes`,
`conversations_store_bytes`): lowered, what no longer fits goes as it goes for room (the least
recently used of the tenant holding the most, from the file too), and its tenant's next request
that names it is told that a reload lowered the budget."""

from __future__ import annotations


class ResizableBudget:
    """`resize` for a store (response_store.py, conversation_store.py) with `budget`, `entries`,
    `lock`, `budget_refusal(bytes)` and `_make_room(keep, why)`; `SETTING` names its budget."""

    SETTING = ""

    def resize(self, budget_bytes: int) -> int:
        """The budget is `budget_bytes` from now: what no longer fits goes, and with 0 every one
        goes and none is kept (ValueError, changing nothing, where `budget_refusal` says why it
        cannot be done live). How many were let go."""
        refusal = self.budget_refusal(budget_bytes)
        if refusal is not None:
            raise ValueError(refusal)
        with self.lock:
            self.budget = budget_bytes
            before = len(self.entries)
            self._make_room(None, f"kvd let it go when a reload lowered {self.SETTING} to {budget_bytes} (its tenant "
                                  "held the most)")
            return before - len(self.entries)
