"""Which URLs may receive webhooks: the rule the gateway applies when it accepts a URL and the
notifier applies again before every delivery (one rule, so the two can never disagree).

Checked without DNS: an absolute `https://` URL of at most 2,048 characters, without
credentials, whose host is a public IP literal or a domain name that is neither local
(`localhost`, `*.localhost`, `*.local`, `*.internal`, single-label names that local search
domains would complete) nor a legacy numeric IPv4 spelling (`2130706433`, `0177.0.0.1`,
`0x7f.1`, `127.1`) that a resolver would turn into an address. The notifier also resolves the
host at delivery time, refuses it when any address is not public (`is_public_address`), and
connects only to the addresses it checked. Pure functions, no I/O.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import SplitResult, urlsplit

MAX_URL_LENGTH = 2_048

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
# An authority holding a bracketed IPv6 literal: nothing but an optional port after `]`.
# `urlsplit` ignores what follows (`[2606:4700::1]x` read as that address) where the HTTP
# client refuses the URL, so such a callback was accepted and could never be delivered.
_BRACKETED_AUTHORITY = re.compile(r"\[[0-9A-Fa-f:.]+\](?::[0-9]*)?")
_LOCAL_SUFFIXES = ("localhost", "local", "internal", "localdomain", "home.arpa", "arpa")
# IPv6 ranges that embed an IPv4 address a gateway may translate to (NAT64) or that
# `is_global` does not flag (the deprecated IPv4-compatible ::a.b.c.d).
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known: the IPv4 address is the last 32 bits
# Never public: the local-use NAT64 prefix (RFC 8215: where it embeds the IPv4 address depends
# on the operator's prefix length, so `64:ff9b:1:a00:0:100:808:808` may be 10.0.0.1 and not
# 8.8.8.8) and the deprecated site-local fec0::/10 (RFC 3879), which `is_global` takes as global.
_NEVER_PUBLIC = (ipaddress.IPv6Network("64:ff9b:1::/48"), ipaddress.IPv6Network("fec0::/10"))


class UnsafeWebhookUrl(ValueError):
    """The URL may not receive webhooks; the message says why."""


def is_public_address(address: IPAddress) -> bool:
    """True for a globally routable unicast address (IPv4-mapped/embedded forms unwrapped)."""
    if isinstance(address, ipaddress.IPv6Address):
        if any(address in network for network in _NEVER_PUBLIC):
            return False
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            return is_public_address(embedded)
        if address in _IPV4_COMPATIBLE:
            return False
    return address.is_global and not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def parse_ip_literal(host: str) -> IPAddress | None:
    """The address when `host` is a canonical IP literal; None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check_host_name(host: str) -> None:
    """Refuse names that are local by definition or that a resolver reads as an address."""
    name = host.removesuffix(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise UnsafeWebhookUrl(f"{host!r} is not a valid host name (use the xn-- form for IDNs)")
    if _NUMERIC_LABEL.match(labels[-1]):
        raise UnsafeWebhookUrl(f"{host!r} is a numeric address form that is not allowed")
    if len(labels) == 1:
        raise UnsafeWebhookUrl(f"{host!r} is a single-label (local) host name")
    if any(name == suffix or name.endswith(f".{suffix}") for suffix in _LOCAL_SUFFIXES):
        raise UnsafeWebhookUrl(f"{host!r} is a local host name")


def validate_webhook_url(url: str) -> str:
    """Return `url` when it may receive webhooks; raise `UnsafeWebhookUrl` otherwise."""
    webhook_host_and_port(url)
    return url


def _split(url: str) -> SplitResult:
    """The URL's parts; `UnsafeWebhookUrl` when `urlsplit` cannot read it (a bracketed host
    that is no IPv6 address, an unclosed bracket, a netloc that NFKC normalisation changes),
    so that every refusal is the one exception its callers turn into their own answer."""
    try:
        return urlsplit(url)
    except ValueError as error:
        raise UnsafeWebhookUrl(f"the URL cannot be parsed: {error}") from error


def webhook_host_and_port(
    url: str, *, exempt_hosts: frozenset[str] = frozenset()
) -> tuple[str, int]:
    """The host and port of a URL that may receive webhooks; `UnsafeWebhookUrl` otherwise.

    `exempt_hosts` skips the host rules for the named hosts (a local test receiver only).
    """
    if len(url) > MAX_URL_LENGTH:
        raise UnsafeWebhookUrl(f"the URL is longer than {MAX_URL_LENGTH} characters")
    if any(ord(char) <= 0x20 or ord(char) == 0x7F or char == "\\" for char in url):
        raise UnsafeWebhookUrl("the URL contains whitespace, control characters or '\\'")
    parts = _split(url)
    if parts.scheme.lower() != "https":
        raise UnsafeWebhookUrl("the URL must start with https://")
    if "@" in parts.netloc:
        raise UnsafeWebhookUrl("the URL may not contain credentials")
    if ("[" in parts.netloc or "]" in parts.netloc) and not _BRACKETED_AUTHORITY.fullmatch(
        parts.netloc
    ):
        raise UnsafeWebhookUrl("an IPv6 address in brackets may be followed only by :port")
    try:
        port = parts.port
    except ValueError as error:
        raise UnsafeWebhookUrl("the URL has an invalid port") from error
    host = parts.hostname or ""
    if not host or port == 0:
        raise UnsafeWebhookUrl("the URL needs a host (and a non-zero port, if any)")
    if "%" in host:
        raise UnsafeWebhookUrl("the URL's host may not carry a zone id or escapes")
    if host in exempt_hosts:
        return host, port or 443
    address = parse_ip_literal(host)
    if address is None:
        check_host_name(host)
    elif not is_public_address(address):
        raise UnsafeWebhookUrl(f"{host} is not a public address")
    return host, port or 443
