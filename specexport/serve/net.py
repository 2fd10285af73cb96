"""Host names: whether a server's address is loopback-only (the API key's and the Host check's rule)."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """A loopback name or address ("localhost", "127.0.0.1", "[::1]"), without its port."""
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
