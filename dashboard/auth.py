"""The bind rule: a dashboard that listens beyond loopback needs a password (DDPDASH_PASSWORD). What
each request must show is checked by dashboard/gate.py."""

from __future__ import annotations

import hmac
import ipaddress

PASSWORD_ENV = "DDPDASH_PASSWORD"
ADDRESS_ENV = "DDPDASH_ADDRESS"


class ExposureError(RuntimeError):
    """Refusing to serve a launcher to the network without a password."""


def is_loopback(address: str) -> bool:
    """Only `localhost` and loopback IP addresses. The empty address, 0.0.0.0 and :: listen on every
    interface; any other name or address may be reachable from elsewhere."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(address: str, password: str | None) -> None:
    if not is_loopback(address) and not password:
        shown = repr(address) if address.strip() == "" else address
        raise ExposureError(
            f"refusing to listen on {shown}: anyone who reaches it could launch processes on this machine. "
            f"Set {PASSWORD_ENV} to a password (every browser then signs in), or bind to 127.0.0.1"
        )


def password_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())  # constant time
