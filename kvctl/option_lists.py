"""Options that take lists: repeated flags and comma-separated values (`--x 1,2 --x 3`)."""

from __future__ import annotations

from .errors import UserError


def parse_int_list(field: str, values: list[str]) -> list[int]:
    """Accept repeated options and comma-separated lists: `--x 1,2 --x 3`."""
    out: list[int] = []
    for value in values:
        for part in value.split(","):
            part = part.strip().replace("_", "")
            if not part:
                continue
            try:
                out.append(int(part))
            except ValueError:
                raise UserError(f"{field}: expected integers, got {part!r}") from None
    return out


def parse_float_list(field: str, value: str) -> list[float]:
    """`1,1,0.5` as numbers; a part that is not one is a UserError naming the field."""
    out = []
    for part in value.split(","):
        try:
            out.append(float(part.strip()))
        except ValueError:
            raise UserError(f"{field}: expected numbers, got {part.strip()!r}") from None
    return out


def parse_names(field: str, values: list[str]) -> list[str]:
    names = [part.strip() for value in values for part in value.split(",") if part.strip()]
    if not names:
        raise UserError(f"{field}: give at least one value")
    return names
