"""HTTP to a live server (``verify --endpoint``, ``bench --endpoint``), bounded in time and memory.

A server we talk to may be anything: slow, endless, not HTTP at all. Every request here has

- one deadline for the whole request (connect, headers, body): a watchdog shuts the socket
  down when it passes, so keep-alive bytes or a trickled body cannot stretch it (a socket
  timeout alone bounds each read, not the request);
- a size cap on the body (and on each line of a stream), so an endless body cannot grow memory;
- one exception type, ``HttpFailure``, whose message is one line: whatever the server sent
  (garbage status line, reset, bad chunking) or did not send.

URLs are checked once by ``parse_http_url`` (scheme, host, port 1..65535) and shown by
``HttpTarget.shown``, which never includes credentials.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from monodecode.errors import MonodecodeError, exception_line

MAX_BODY_BYTES = 16 << 20  # a /metrics page or a model list; far above what vLLM serves
MAX_LINE_BYTES = 1 << 20  # one server-sent-events line of a streamed completion
MAX_TIMEOUT_S = 24 * 3600.0  # a request that may take longer than a day is a mistake


class HttpFailure(Exception):
    """A request to a live server did not produce a usable answer; the message is one line."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class HttpTarget:
    """A checked http(s) URL: scheme, host, port and path (credentials are refused)."""

    scheme: str
    host: str
    port: int
    path: str

    @property
    def origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def shown(self) -> str:
        return self.origin + self.path

    def with_path(self, path: str) -> HttpTarget:
        return HttpTarget(self.scheme, self.host, self.port, path)


def _redacted(text: str) -> str:
    """``text`` with any ``user:password@`` of a URL replaced, and cut to a sane length."""
    scheme, sep, rest = text.partition("://")
    if sep:
        authority, slash, tail = rest.partition("/")
        if "@" in authority:
            rest = "***@" + authority.rsplit("@", 1)[1] + slash + tail
        text = scheme + sep + rest
    return text if len(text) <= 200 else text[:197] + "..."


def parse_http_url(text: str, option: str, example: str) -> HttpTarget:
    """``text`` as an ``HttpTarget``; a ``MonodecodeError`` naming ``option`` otherwise."""
    bad = f"{option} must be an http(s) URL such as {example}, got {_redacted(text)!r}"
    try:
        parsed = urllib.parse.urlsplit(text)
        port = parsed.port
    except ValueError as e:  # a port that is not a number or not in 0..65535, a bad IPv6 literal
        raise MonodecodeError(f"{bad} ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or any(c.isspace() for c in text):
        raise MonodecodeError(bad)
    if parsed.username is not None or parsed.password is not None:
        raise MonodecodeError(f"{option} {_redacted(text)!r}: credentials in the URL are not supported")
    if port == 0:
        raise MonodecodeError(f"{bad} (port 0)")
    default = 443 if parsed.scheme == "https" else 80
    return HttpTarget(parsed.scheme, parsed.hostname, port or default, parsed.path or "/")


def check_timeout(seconds: float, option: str) -> float:
    """A request timeout: positive, finite, at most a day."""
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise MonodecodeError(f"{option} must be > 0 and at most {MAX_TIMEOUT_S:g} seconds, got {seconds}")
    return seconds


class _Watchdog:
    """Shuts the connection's socket down at the deadline: a blocked read then returns at once.
    It holds the socket itself: the connection lets go of it once a response says it will close."""

    def __init__(self, timeout_s: float):
        self.expired = False
        self.sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self.sock = sock
            if self.expired:
                self._shutdown()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            self._shutdown()

    def _shutdown(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


@contextlib.contextmanager
def _response(
    target: HttpTarget, method: str, body: bytes | None, timeout_s: float
) -> Iterator[http.client.HTTPResponse]:
    conn_cls = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(target.host, target.port, timeout=timeout_s)  # the timeout bounds the connect
    watchdog = _Watchdog(timeout_s)
    late = f"no complete answer within {timeout_s:g} s"
    try:
        try:
            conn.connect()
            watchdog.watch(conn.sock)
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, target.path, body=body, headers=headers)
            resp = conn.getresponse()
            yield resp
        except Exception as e:
            # past the deadline, whatever broke (a cut body the caller could not parse) broke
            # because the watchdog cut the connection
            if watchdog.expired or isinstance(e, TimeoutError):
                raise HttpFailure(late) from None
            if isinstance(e, (OSError, http.client.HTTPException)):
                raise HttpFailure(_reason(e)) from None
            if isinstance(e, ValueError) and not isinstance(e, MonodecodeError):  # http.client's bad chunk sizes
                raise HttpFailure(_reason(e)) from None
            raise
        if watchdog.expired:  # the body ended because the watchdog cut it
            raise HttpFailure(late)
    finally:
        watchdog.cancel()
        conn.close()


def _reason(e: BaseException) -> str:
    if isinstance(e, http.client.BadStatusLine):
        return "the answer is not HTTP (bad status line)"
    if isinstance(e, http.client.IncompleteRead):
        return "the answer ended early"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host ({e.strerror or e})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return exception_line(e, 200)


def _failed_status(resp: http.client.HTTPResponse, what: str) -> HttpFailure:
    return HttpFailure(f"{what} answered HTTP {resp.status}", status=resp.status)


def get(target: HttpTarget, timeout_s: float, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The body of ``GET target`` (status 200), at most ``max_bytes``, within ``timeout_s``."""
    with _response(target, "GET", None, timeout_s) as resp:
        if resp.status != 200:
            raise _failed_status(resp, f"GET {target.path}")
        chunks, size = [], 0
        while chunk := resp.read1(1 << 16):
            size += len(chunk)
            if size > max_bytes:
                raise HttpFailure(f"GET {target.path}: the answer is larger than {max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


@contextlib.contextmanager
def post_stream(
    target: HttpTarget, body: bytes, timeout_s: float, max_line: int = MAX_LINE_BYTES
) -> Iterator[Iterator[bytes]]:
    """``POST target`` and its body as lines (without line ends), each at most ``max_line``
    bytes; the whole request, stream included, ends within ``timeout_s``. A status other than
    200 is an ``HttpFailure`` carrying the start of the server's answer."""
    with _response(target, "POST", body, timeout_s) as resp:
        if resp.status != 200:
            detail = " ".join(resp.read1(300).decode("utf-8", "replace").split())
            raise HttpFailure(
                f"POST {target.path} answered HTTP {resp.status}" + (f": {detail}" if detail else ""), resp.status
            )
        yield _lines(resp, target, max_line)


def _lines(resp: http.client.HTTPResponse, target: HttpTarget, max_line: int) -> Iterator[bytes]:
    pending = b""
    while chunk := resp.read1(1 << 16):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r")
        if len(pending) > max_line:
            raise HttpFailure(f"POST {target.path}: a line of the stream is longer than {max_line} bytes")
    if pending:
        yield pending.rstrip(b"\r")
