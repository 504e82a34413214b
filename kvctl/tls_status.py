"""The line `kvctl status` gives the TLS of a TCP front, kvd's or kvd router's (daemon/server/tls.py)."""

from __future__ import annotations

import time

from rich.text import Text


def tls_text(tls: dict) -> Text:
    """The TCP front's certificate (daemon/server/tls.py): subject, names, expiry; yellow with kvd's
    warning when it has expired, is not valid yet, or expires within two weeks."""
    expires = time.strftime("%Y-%m-%d", time.gmtime(tls["not_after"]))
    names = f" ({', '.join(tls['names'])})" if tls["names"] else ""
    line = (f"{tls['subject']}{names}, expires {expires} ({tls['days_left']:g} days)"
            + (f"; client certificates required ({tls['client_cas']} CA{'' if tls['client_cas'] == 1 else 's'})"
               if tls["client_certificates"] and "client_cas" in tls else
               "; client certificates required" if tls["client_certificates"] else "")
            + (f"; rotated {tls['rotations']} time{'s' if tls['rotations'] != 1 else ''} since start"
               if tls["rotations"] else ""))
    if tls.get("warning"):
        return Text(f"{line}: {tls['warning']}", style="yellow")
    return Text(line)
