"""The web gate (dashboard/gate.py, dashboard/auth.py): the bind rule, the host check against DNS
rebinding, the per-start token, the password with its brake, and what an unauthenticated client can
reach — against the real server `ddpdash ui` starts, with raw HTTP and websocket clients."""

from __future__ import annotations

import asyncio
import http.client
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from ddpdash.dashboard.auth import ExposureError, check_exposure
from ddpdash.dashboard.gate import LOGIN_PATH, LoginBrake
from tests.conftest import ROOT

PASSWORD = "s3cret-pw"


# ---- the bind rule -------------------------------------------------------------------------------
@pytest.mark.parametrize("address", ["", " ", "0.0.0.0", "::", "[::]", "my-laptop", "192.168.1.5", "10.0.0.2"])
def test_every_address_but_loopback_needs_a_password(address: str) -> None:
    with pytest.raises(ExposureError, match="refusing to listen on"):
        check_exposure(address, None)
    check_exposure(address, PASSWORD)  # with one, it may listen


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_password(address: str) -> None:
    check_exposure(address, None)


def ui(home: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    full = {**os.environ, "DDPDASH_HOME": str(home), **env}
    for name in ("DDPDASH_PASSWORD", "DDPDASH_DB_URL", "DDPDASH_TOKEN", "DDPDASH_ALLOWED_HOSTS"):
        if name not in env:
            full.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "ddpdash.cli", "ui", *args], env=full, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_empty_bind_address_refuses_to_start_without_a_password(tmp_path: Path, how: str) -> None:
    proc = ui(tmp_path, "--port", str(free_port()), *(["--address", ""] if how == "flag" else []),
              **({"DDPDASH_ADDRESS": ""} if how == "environment" else {}))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "refusing to listen on ''" in out and "DDPDASH_PASSWORD" in out


# ---- the brake, unit ------------------------------------------------------------------------------
def test_the_brake_lets_five_failures_through_then_doubles_the_wait() -> None:
    now = [1000.0]
    brake = LoginBrake(clock=lambda: now[0])
    for _ in range(5):
        assert brake.wait_s("1.2.3.4") == 0
        brake.failed("1.2.3.4")
    assert brake.wait_s("1.2.3.4") == 0  # the fifth failure is still free
    brake.failed("1.2.3.4")
    assert brake.wait_s("1.2.3.4") == 1.0 and brake.wait_s("5.6.7.8") == 0  # per client
    now[0] += 1.0
    brake.failed("1.2.3.4")
    assert brake.wait_s("1.2.3.4") == 2.0
    brake.succeeded("1.2.3.4")
    assert brake.wait_s("1.2.3.4") == 0


# ---- the real server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, proc: subprocess.Popen[str], port: int, first_url: str) -> None:
        self.proc, self.port, self.first_url = proc, port, first_url

    def request(self, path: str, *, method: str = "GET", host: str | None = None, cookie: str = "",
                body: str = "") -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Host": host or f"127.0.0.1:{self.port}"}
        if cookie:
            headers["Cookie"] = cookie
        if body:
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        conn.request(method, path, body=body or None, headers=headers)
        response = conn.getresponse()
        response.read()
        return response

    def websocket_status(self, *, host: str | None = None, origin: str | None = None, cookie: str = "") -> int:
        """101 when the websocket is accepted, else the HTTP status the handshake was refused with."""
        return asyncio.run(self._websocket(host or f"127.0.0.1:{self.port}", origin, cookie))

    async def _websocket(self, host: str, origin: str | None, cookie: str) -> int:
        sock = socket.create_connection(("127.0.0.1", self.port))  # to this server, whatever Host says
        headers = {"Cookie": cookie} if cookie else {}
        try:
            async with websockets.connect(f"ws://{host}/_stcore/stream", sock=sock, origin=origin,  # type: ignore[arg-type]
                                          additional_headers=headers, subprotocols=["streamlit"],  # type: ignore[list-item]
                                          open_timeout=30):
                return 101
        except websockets.InvalidStatus as exc:
            return exc.response.status_code


def start(home: Path, address: str = "127.0.0.1", **env: str) -> Server:
    port = free_port()
    proc = ui(home, "--port", str(port), "--address", address, **env)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    match = re.search(r"dashboard on (\S+)", first)
    assert match, first
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if Server(proc, port, "").request("/_stcore/health").status == 200:
                return Server(proc, port, match.group(1))
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("the dashboard did not become healthy within 60 s")


def stop(server: Server) -> None:
    server.proc.terminate()
    server.proc.wait(10)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start(tmp_path_factory.mktemp("gate") / "home")
    yield server
    stop(server)


def cookie_from(response: http.client.HTTPResponse) -> str:
    header = response.getheader("set-cookie") or ""
    return header.split(";")[0]


@pytest.mark.slow
def test_a_foreign_host_is_refused_over_http_and_websocket(local: Server) -> None:
    """DNS rebinding: a page on attacker.example whose name now resolves to 127.0.0.1."""
    token_path = urllib.parse.urlsplit(local.first_url)
    cookie = cookie_from(local.request(f"/?{token_path.query}"))
    rebound = f"attacker.example:{local.port}"
    assert local.request("/", host=rebound, cookie=cookie).status == 403
    assert local.request(f"/?{token_path.query}", host=rebound).status == 403
    assert local.websocket_status(host=rebound, origin=f"http://{rebound}") == 403
    assert local.websocket_status(host=rebound, origin=f"http://{rebound}", cookie=cookie) == 403
    assert local.websocket_status(origin="http://evil.example", cookie=cookie) == 403  # another site's page
    assert local.websocket_status(origin=f"http://localhost:{local.port}", cookie=cookie) == 101


@pytest.mark.slow
def test_without_the_start_token_nothing_is_reachable(local: Server) -> None:
    assert local.first_url.startswith(f"http://127.0.0.1:{local.port}/?token=")
    for path in ("/", "/new", "/live?run=1", "/_stcore/metrics", "/_stcore/host-config"):
        assert local.request(path).status == 403, path
    assert local.request("/?token=wrong").status == 403
    assert local.websocket_status(origin=f"http://127.0.0.1:{local.port}") == 403
    assert local.request("/_stcore/health").status == 200  # for process managers
    token = urllib.parse.parse_qs(urllib.parse.urlsplit(local.first_url).query)["token"][0]
    first = local.request(f"/runs?token={token}&sort=id")
    assert first.status == 303 and first.getheader("location") == "/runs?sort=id"  # the token leaves the URL
    cookie = cookie_from(first)
    assert "HttpOnly" in (first.getheader("set-cookie") or "")
    assert local.request("/runs?sort=id", cookie=cookie).status == 200
    assert local.websocket_status(origin=f"http://127.0.0.1:{local.port}", cookie=cookie) == 101


@pytest.fixture(scope="module")
def public(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start(tmp_path_factory.mktemp("gate-pw") / "home", address="0.0.0.0", DDPDASH_PASSWORD=PASSWORD)
    yield server
    stop(server)


def sign_in(server: Server, password: str, next_path: str = "/") -> http.client.HTTPResponse:
    return server.request(f"{LOGIN_PATH}?next={urllib.parse.quote(next_path)}", method="POST",
                          body=urllib.parse.urlencode({"password": password, "next": next_path}))


@pytest.mark.slow
def test_the_password_gates_everything_and_a_deep_link_survives_the_sign_in(public: Server) -> None:
    assert public.first_url == f"http://127.0.0.1:{public.port}/"  # no token: the password is asked
    asked = public.request("/live?run=3")
    assert asked.status == 303 and asked.getheader("location") == f"{LOGIN_PATH}?next=%2Flive%3Frun%3D3"
    for path in ("/_stcore/metrics", "/new"):
        assert public.request(path).status == 303, path
    assert public.websocket_status(origin=f"http://127.0.0.1:{public.port}") == 403  # no clear_cache either
    assert public.request(LOGIN_PATH).status == 200
    signed = sign_in(public, PASSWORD, "/live?run=3")
    assert signed.status == 303 and signed.getheader("location") == "/live?run=3"
    cookie = cookie_from(signed)
    assert public.request("/live?run=3", cookie=cookie).status == 200
    assert public.request("/_stcore/metrics", cookie=cookie).status == 200
    assert public.websocket_status(origin=f"http://127.0.0.1:{public.port}", cookie=cookie) == 101
    assert sign_in(public, PASSWORD, "https://evil.example/").getheader("location") == "/"  # no open redirect


@pytest.mark.slow
def test_repeated_wrong_passwords_are_slowed_and_logged(tmp_path: Path) -> None:
    server = start(tmp_path / "home", address="0.0.0.0", DDPDASH_PASSWORD=PASSWORD)
    try:
        assert [sign_in(server, f"guess-{i}").status for i in range(6)] == [401] * 6
        assert sign_in(server, "guess-6").status == 429  # after the sixth failure, a second's wait
        assert sign_in(server, PASSWORD).status == 429  # the right one too, until the wait is over
        time.sleep(1.1)
        assert sign_in(server, PASSWORD).status == 303
    finally:
        stop(server)
    out = server.proc.stdout.read() if server.proc.stdout else ""
    assert len(re.findall(r"failed sign-in from 127\.0\.0\.1 \(\d+ in a row\)", out)) == 6
