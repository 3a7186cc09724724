"""Password gate: required whenever the dashboard listens beyond loopback (DDPDASH_PASSWORD)."""

from __future__ import annotations

import hmac
import ipaddress
import os

PASSWORD_ENV = "DDPDASH_PASSWORD"
ADDRESS_ENV = "DDPDASH_ADDRESS"


class ExposureError(RuntimeError):
    """Refusing to serve a launcher to the network without a password."""


def is_loopback(address: str) -> bool:
    if address in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def check_exposure(address: str, password: str | None) -> None:
    if not is_loopback(address) and not password:
        raise ExposureError(
            f"refusing to listen on {address}: anyone who reaches it could launch processes on this machine. "
            f"Set {PASSWORD_ENV} to a password (every browser session then asks for it), or bind to 127.0.0.1"
        )


def password_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())  # constant time


def gate() -> bool:
    """True when this browser session may see the app; otherwise shows the password prompt."""
    import streamlit as st

    expected = os.environ.get(PASSWORD_ENV, "")
    if not expected or st.session_state.get("_ddpdash_authenticated"):
        return True
    st.title("ddpdash")
    with st.form("login"):
        given = st.text_input("Password", type="password")
        if st.form_submit_button("Sign in"):
            if password_matches(given, expected):
                st.session_state["_ddpdash_authenticated"] = True
                st.rerun()
            st.error("Wrong password.")
    return False
