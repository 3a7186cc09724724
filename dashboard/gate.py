"""The web gate: an ASGI middleware in front of every request the dashboard's server answers, before
Streamlit sees it. Runs in the dashboard's process.

The dashboard launches processes, so nobody may drive it who could not also type at this machine:

- **Host check.** A request whose `Host` (or a websocket's `Origin`) is not this server's own name is
  refused: that is what DNS rebinding sends, a web page the user merely visits pretending to be
  `attacker.example:8501` while resolving to 127.0.0.1. Allowed: the bound address, `localhost`,
  127.0.0.1, ::1 and the names in DDPDASH_ALLOWED_HOSTS (comma-separated); bound to every interface
  (0.0.0.0, ::) with no such list, any host is accepted, and the password below is what protects it.
- **Loopback without a password: a per-start token**, as Jupyter does. `ddpdash ui` prints the link
  (`/?token=…`); the first request carrying it gets a cookie and is redirected to the same address
  without the token. Everything else — pages, the websocket, Streamlit's own endpoints — needs that
  cookie. DDPDASH_TOKEN fixes the token instead of drawing a new one at each start.
- **Anywhere else: the password (DDPDASH_PASSWORD)**, asked by a sign-in page before Streamlit is
  reached at all (so an unauthenticated client can neither open the websocket nor read
  `/_stcore/metrics`). Failed attempts are logged and slowed per client (LoginBrake), and the page
  asked for (`/new`, `/?run=3`) is where a successful sign-in lands.

`/_stcore/health` answers without either, for process managers' health checks.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import html
import logging
import os
import secrets
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from .auth import ADDRESS_ENV, PASSWORD_ENV, password_matches

log = logging.getLogger(__name__)

TOKEN_ENV = "DDPDASH_TOKEN"
ALLOWED_HOSTS_ENV = "DDPDASH_ALLOWED_HOSTS"
COOKIE = "ddpdash_auth"
LOGIN_PATH = "/ddpdash/sign-in"
HEALTH_PATH = "/_stcore/health"
ALL_INTERFACES = ("", "0.0.0.0", "::")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class GateSettings:
    address: str  # the address the server is bound to
    password: str  # "" on loopback: the token is asked instead
    token: str
    allowed_hosts: frozenset[str]  # empty: any host (bound to every interface, password required)
    secret: bytes  # signs the cookie; new at every start, so a restart signs everyone out

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> GateSettings:
        address = env.get(ADDRESS_ENV, "127.0.0.1")
        password = env.get(PASSWORD_ENV, "")
        extra = {h.strip().lower() for h in env.get(ALLOWED_HOSTS_ENV, "").split(",") if h.strip()}
        if address in ALL_INTERFACES and not extra:
            hosts: frozenset[str] = frozenset()
        else:
            own = {"localhost", "127.0.0.1", "::1"} | ({address.lower()} if address not in ALL_INTERFACES else set())
            hosts = frozenset(own | extra)
        return cls(address, password, env.get(TOKEN_ENV) or secrets.token_urlsafe(24), hosts,
                   secrets.token_bytes(32))

    @property
    def cookie_value(self) -> str:
        return hmac.new(self.secret, b"signed-in", hashlib.sha256).hexdigest()

    def host_allowed(self, host_header: str) -> bool:
        return not self.allowed_hosts or host_name(host_header) in self.allowed_hosts


def host_name(host_header: str) -> str:
    """The name in a Host header or an Origin's authority, without the port; IPv6 without brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host


def origin_host(origin: str) -> str:
    return urllib.parse.urlsplit(origin).netloc


class LoginBrake:
    """Slows repeated failed sign-ins per client: FREE_FAILURES free tries, then each further try waits
    twice as long as the one before (1 s, 2 s, 4 s … at most MAX_WAIT_S). A success forgets the client.
    Bounded: at most MAX_CLIENTS are remembered, the oldest forgotten first."""

    FREE_FAILURES = 5
    MAX_WAIT_S = 300.0
    MAX_CLIENTS = 10_000

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()

    def wait_s(self, client: str) -> float:
        """Seconds before this client may try again (0: now)."""
        with self._lock:
            _, allowed_at = self._failures.get(client, (0, 0.0))
        return max(0.0, allowed_at - self._clock())

    def failed(self, client: str) -> int:
        with self._lock:
            count = self._failures.pop(client, (0, 0.0))[0] + 1
            excess = count - self.FREE_FAILURES
            wait = min(self.MAX_WAIT_S, 2.0 ** (excess - 1)) if excess > 0 else 0.0
            self._failures[client] = (count, self._clock() + wait)
            while len(self._failures) > self.MAX_CLIENTS:
                self._failures.popitem(last=False)
        return count

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._failures.pop(client, None)


class WebGate:
    """ASGI middleware: the host check, then the token or the password, then Streamlit."""

    def __init__(self, app: App, settings: GateSettings | None = None, brake: LoginBrake | None = None) -> None:
        self.app = app
        self.settings = settings or GateSettings.from_env(os.environ)
        self.brake = brake or LoginBrake()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        headers = _headers(scope)
        if not self._from_here(scope, headers):
            log.warning("refused a %s for host %r (origin %r): not this server's name (DNS rebinding?)",
                        scope["type"], headers.get("host", ""), headers.get("origin", ""))
            await _refuse(scope, send, 403, "This address is not this dashboard's. Open it by its own name "
                          f"(or add the name to {ALLOWED_HOSTS_ENV}).")
            return
        path = scope.get("path", "")
        if path == HEALTH_PATH or self._signed_in(headers):
            await self.app(scope, receive, send)
        elif self.settings.password:
            if path == LOGIN_PATH and scope["type"] == "http":
                await self._sign_in(scope, receive, send)
            else:
                await self._ask_to_sign_in(scope, send)
        elif scope["type"] == "http" and _query(scope).get("token") == self.settings.token:
            await _redirect(send, _without_token(scope), cookie=self._cookie())
        else:
            await _refuse(scope, send, 403, "Open the dashboard with the link `ddpdash ui` printed (it carries "
                          "this start's token).")

    # ---- checks ------------------------------------------------------------------------------
    def _from_here(self, scope: Scope, headers: Mapping[str, str]) -> bool:
        if not self.settings.host_allowed(headers.get("host", "")):
            return False
        origin = headers.get("origin")
        return scope["type"] != "websocket" or origin is None or self.settings.host_allowed(origin_host(origin))

    def _signed_in(self, headers: Mapping[str, str]) -> bool:
        given = _cookies(headers.get("cookie", "")).get(COOKIE, "")
        return bool(given) and hmac.compare_digest(given, self.settings.cookie_value)

    def _cookie(self) -> str:
        return f"{COOKIE}={self.settings.cookie_value}; Path=/; HttpOnly; SameSite=Lax"

    # ---- the password ------------------------------------------------------------------------
    async def _ask_to_sign_in(self, scope: Scope, send: Send) -> None:
        if scope["type"] == "websocket":
            await _refuse(scope, send, 403, "sign in first")
            return
        target = scope.get("path", "/") + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else "")
        await _redirect(send, f"{LOGIN_PATH}?{urllib.parse.urlencode({'next': target})}")

    async def _sign_in(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = (scope.get("client") or ("?", 0))[0]
        if scope.get("method") != "POST":
            await _html(send, 200, _sign_in_page(_safe_next(_query(scope).get("next", "/")), ""))
            return
        form = urllib.parse.parse_qs((await _body(receive)).decode("utf-8", "replace"))
        target = _safe_next(form.get("next", ["/"])[0])  # kept through failed attempts
        wait = self.brake.wait_s(client)
        if wait > 0:
            await _html(send, 429, _sign_in_page(target, f"Too many failed attempts: try again in {wait:.0f} s."))
            return
        if password_matches(form.get("password", [""])[0], self.settings.password):
            self.brake.succeeded(client)
            await _redirect(send, target, cookie=self._cookie())
            return
        count = self.brake.failed(client)
        log.warning("failed sign-in from %s (%d in a row)", client, count)
        await _html(send, 401, _sign_in_page(target, "Wrong password."))


# ---- plain ASGI helpers --------------------------------------------------------------------------
def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _query(scope: Scope) -> dict[str, str]:
    return dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1")))


def _cookies(header: str) -> dict[str, str]:
    out = {}
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name:
            out[name] = value
    return out


def _without_token(scope: Scope) -> str:
    query = [(k, v) for k, v in urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1"))
             if k != "token"]
    return scope.get("path", "/") + (f"?{urllib.parse.urlencode(query)}" if query else "")


def _safe_next(target: str) -> str:
    """Only a path on this server: never an open redirect to another site."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


async def _body(receive: Receive, limit: int = 64 * 1024) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b""
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _refuse(scope: Scope, send: Send, status: int, text: str) -> None:
    if scope["type"] == "websocket":
        # Before accepting: the client sees the handshake refused with this HTTP status.
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
        await send({"type": "websocket.http.response.body", "body": text.encode()})
        return
    await _html(send, status, f"<p>{html.escape(text)}</p>")


async def _redirect(send: Send, location: str, cookie: str | None = None) -> None:
    headers = [(b"location", location.encode("latin-1")), (b"content-length", b"0")]
    if cookie:
        headers.append((b"set-cookie", cookie.encode("latin-1")))
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _html(send: Send, status: int, body: str) -> None:
    page = f"<!doctype html><html><head><meta charset='utf-8'><title>ddpdash</title></head><body>{body}</body></html>"
    data = page.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/html; charset=utf-8"),
                            (b"content-length", str(len(data)).encode()), (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": data})


def _sign_in_page(target: str, message: str) -> str:
    note = f"<p role='alert'>{html.escape(message)}</p>" if message else ""
    return (f"<h1>ddpdash</h1>{note}<form method='post' action='{LOGIN_PATH}'>"
            f"<input type='hidden' name='next' value='{html.escape(target, quote=True)}'>"
            "<label>Password <input type='password' name='password' autofocus></label> "
            "<button type='submit'>Sign in</button></form>")

