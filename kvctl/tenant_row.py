"""One tenant's row of `GET /admin/tenants?tenant=T` (`kvctl tenants --tenant T`, `kvctl hit-curve --tenant T`)."""

from __future__ import annotations

from .errors import UserError


def listed_row(body: dict, tenant: str, instead: str) -> dict:
    """`tenant`'s row of an /admin/tenants answer, or an error that says how many tenants kvd lists
    and `instead`: the command that lists them. (A kvd of before `?tenant=` answers every row.)"""
    row = next((row for row in body["tenants"] if row["tenant"] == tenant), None)
    if row is not None:
        return row
    listed = body.get("listed", None if "replicas" in body else len(body["tenants"]))
    among = f" among its {listed:,} tenants" if listed is not None else ""
    raise UserError(f"tenant: kvd lists no {tenant!r}{among} (those active most recently, and those holding "
                    f"blocks, pins or requests: {instead})")
