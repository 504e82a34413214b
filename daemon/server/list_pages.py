"""A page of an OpenAI list (`after`, `before`, `limit`, `order`): a response's input items, a
conversation's items, a tenant's batches. Free of the model's imports: kvd router pages with it
too, and never imports torch."""

from __future__ import annotations

from .chat_messages import MessagesError

ITEMS_PAGE = (1, 100, 20)  # a page of input items: the fewest, the most, and how many when `limit` is left out


def input_items_page(items: list[dict] | tuple[dict, ...], after: str | None, before: str | None,
                     limit: str | None, order: str | None, whose: str = "response") -> dict:
    """A page of a response's input items (`GET /v1/responses/{id}/input_items`), as OpenAI's
    list: `order` "desc" (the default: the latest first) or "asc"; `after` and `before` name an
    item of the list (in that order) the page starts after or ends before; `limit` items at most.
    MessagesError names the query parameter at fault. A conversation's items are listed the same
    way (`whose`: "conversation")."""
    least, most, default = ITEMS_PAGE
    order = "desc" if order is None else order
    if order not in ("asc", "desc"):
        raise MessagesError(f"order: must be asc or desc, got {order!r}", "order")
    try:
        count = default if limit is None else int(limit)
    except ValueError:
        count = None
    if count is None or not least <= count <= most:
        raise MessagesError(f"limit: must be a whole number from {least} to {most}, got {limit!r}", "limit")
    listed = list(items) if order == "asc" else list(reversed(items))
    ids = [item["id"] for item in listed]
    start, end = 0, len(listed)
    for name, given in (("after", after), ("before", before)):
        if given is None:
            continue
        if given not in ids:
            raise MessagesError(f"{name}: no {'input ' if whose == 'response' else ''}item {given!r} in this "
                                f"{whose}'s list", name)
        if name == "after":
            start = ids.index(given) + 1
        else:
            end = ids.index(given)
    window = listed[start:end]
    page = window[:count] if before is None or after is not None else window[-count:]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(page) < len(window)}
