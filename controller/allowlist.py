"""Is a peer's address in an allow list (`allowed_clients`, `allowed_calculators`)?

The UDP door and the HTTP door ask it for every datagram or connection, so the answer is
remembered per host, in a cache a flood of sources cannot grow without bound.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

Networks = Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]

# Hosts remembered by `cached_allowed` before its cache starts again.
CACHE_HOSTS = 10_000


def cached_allowed(host: str, networks: Networks, cache: dict[str, bool]) -> bool:
    """`address_allowed`, remembered per host (a flood of sources cannot grow it unbounded)."""
    allowed = cache.get(host)
    if allowed is None:
        allowed = address_allowed(host, networks)
        if len(cache) > CACHE_HOSTS:
            cache.clear()
        cache[host] = allowed
    return allowed


def address_allowed(host: str, networks: Networks) -> bool:
    """Is `host` (an IP address as text) in one of `networks`? IPv4-mapped IPv6 counts as IPv4."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in networks)
