"""A hostile HTTP server for the endpoint commands (``verify --endpoint``, ``bench --endpoint``).

A raw TCP server on 127.0.0.1 that answers each request path with a scripted ``Answer``: any
status line (or bytes that are not HTTP), framing by length, by chunks, by closing, or broken
(a length longer than the body, a bad chunk size), pieces sent with delays, an endless tail, or
a connection held open without a byte more. ``answers()`` is the Hypothesis strategy of
answers; ``valid_*`` are well-formed answers, so a drawn script can reach every stage of a
command before something goes wrong.

Imported by sibling test modules as ``hostile_http`` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

from hypothesis import strategies as st

ENDLESS_CAP_S = 20.0  # an endless answer stops by itself after this long (the client should stop far sooner)


@dataclass(frozen=True)
class Answer:
    status: bytes = b"HTTP/1.1 200 OK"
    pieces: tuple[bytes, ...] = ()
    framing: str = "length"  # length | chunked | close | short_length | bad_chunk
    delay_s: float = 0.0  # before each piece
    endless: bytes = b""  # repeated after the pieces until the client goes away
    hang: bool = False  # after the pieces: keep the connection open, send nothing more


def sse(*events: object, keepalive: bool = False) -> tuple[bytes, ...]:
    """Server-sent events: each event as ``data: <json>`` (bytes/str as they are)."""
    out = []
    for e in events:
        data = e if isinstance(e, (bytes, str)) else json.dumps(e)
        out.append(b"data: " + (data.encode() if isinstance(data, str) else data) + b"\n\n")
        if keepalive:
            out.append(b": ping\n\n")
    return tuple(out)


def valid_models(model: str = "tiny") -> Answer:
    return Answer(pieces=(json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode(),))


METRICS_OK = (
    b"# TYPE monodecode_enabled gauge\nmonodecode_enabled 1\n"
    b'# TYPE monodecode_steps_total counter\nmonodecode_steps_total{path="mono"} 5\n'
    b'monodecode_steps_total{path="fallback"} 1\n'
    b'# TYPE monodecode_fallback_steps_total counter\nmonodecode_fallback_steps_total{reason="prefill"} 1\n'
    b"# TYPE monodecode_step_duration_seconds histogram\n"
    b'monodecode_step_duration_seconds_bucket{le="+Inf"} 5\nmonodecode_step_duration_seconds_count 5\n'
    b"monodecode_step_duration_seconds_sum 0.5\n"
    b'# TYPE monodecode_failstop_total counter\nmonodecode_failstop_total{site="k1"} 0\n'
)


def valid_metrics() -> Answer:
    return Answer(pieces=(METRICS_OK,))


def valid_completion(tokens: int = 2) -> Answer:
    text = [{"choices": [{"index": 0, "text": "x"}]} for _ in range(tokens)]
    usage = {"choices": [], "usage": {"completion_tokens": tokens}}
    return Answer(pieces=sse(*text, usage, "[DONE]"), framing="chunked")


_STATUS = st.one_of(
    st.sampled_from(
        [
            b"HTTP/1.1 200 OK",
            b"HTTP/1.0 200 OK",
            b"HTTP/1.1 200",
            b"HTTP/1.1 404 Not Found",
            b"HTTP/1.1 500 Internal Server Error",
            b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:1/",
            b"HTTP/1.1 999 What",
            b"SSH-2.0-OpenSSH_9.6",
            b"",
        ]
    ),
    st.binary(max_size=24).filter(lambda b: b"\n" not in b),
)
_OK = st.just(b"HTTP/1.1 200 OK")
_FRAMING = st.sampled_from(["length", "chunked", "close", "short_length", "bad_chunk"])
_DELAY = st.one_of(st.just(0.0), st.floats(0.0, 0.02), st.just(0.3))

_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)

_MODELS_BODIES = st.one_of(
    st.just(b'{"data": [{"id": 7}]}'),
    st.just(b'{"data": [{"id": "a"}, {"id": "b"}]}'),
    st.just(b'{"data": [{"id": "[/]"}]}'),
    st.just(b'{"data": {"id": "x"}}'),
    st.just(b"[1, 2]"),
    st.just(b"\xff\xfe not utf-8"),
    st.just(b"[" * 100_000),
    st.just(b'{"data": [{"id": "tiny"}], "n": 1e999}'),
    _JSON_VALUES.map(lambda v: json.dumps({"data": v}).encode()),
    st.binary(max_size=64),
)

_METRICS_BODIES = st.one_of(
    st.just(METRICS_OK),
    st.just(METRICS_OK.replace(b"} 5\n", b"} -824\n")),
    st.just(METRICS_OK.replace(b"} 5\n", b"} NaN\n")),
    st.just(METRICS_OK.replace(b"monodecode_enabled 1", b"monodecode_enabled +Inf")),
    st.just(b"monodecode_steps_total{path=\n"),
    st.just(b"\xff\xfe\x00garbage"),
    st.just(b'# TYPE x counter\nx_total{a="1"} lots\n'),
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
)

_CHUNKS = st.one_of(
    st.just({"choices": [{"text": "x"}]}),
    st.just([1, 2, 3]),
    st.just("a string"),
    st.just({"choices": "nope"}),
    st.just({"choices": [7]}),
    st.just({"choices": [], "usage": {"completion_tokens": "lots"}}),
    st.just({"choices": [], "usage": {"completion_tokens": -824}}),
    st.just({"choices": [], "usage": {"completion_tokens": 10**30}}),
    st.just({"choices": [], "usage": [1]}),
    st.just("[DONE]"),
    st.just(b"{not json"),
    st.just(b"\xff\xfe"),
    st.just(b"[" * 100_000),
    _JSON_VALUES,
)

_COMPLETIONS = st.one_of(
    st.builds(lambda evs, ka: sse(*evs, keepalive=ka), st.lists(_CHUNKS, max_size=5), st.booleans()),
    st.lists(st.binary(max_size=40), max_size=4).map(tuple),
)


def _answer(status, bodies) -> st.SearchStrategy[Answer]:
    return st.builds(
        Answer,
        status=status,
        pieces=bodies,
        framing=_FRAMING,
        delay_s=_DELAY,
        endless=st.sampled_from([b"", b"", b"", b"x" * 4096, b": ping\n\n", b"data: {}\n"]),
        hang=st.booleans(),
    )


def answers(kind: str) -> st.SearchStrategy[Answer]:
    """Answers for ``kind`` (models | metrics | completions): mostly 200 with a hostile body,
    sometimes any status line; the valid answer of that kind is among them."""
    if kind == "models":
        bodies = _MODELS_BODIES.map(lambda b: (b,))
        valid = st.just(valid_models())
    elif kind == "metrics":
        bodies = st.one_of(_METRICS_BODIES.map(lambda b: (b,)), st.lists(st.binary(max_size=30), max_size=3).map(tuple))
        valid = st.just(valid_metrics())
    else:
        bodies = _COMPLETIONS
        valid = st.just(valid_completion())
    return st.one_of(valid, _answer(_OK, bodies), _answer(_STATUS, bodies))


class HostileServer:
    """Serves ``script`` (request path prefix -> ``Answer``; unknown paths get a 404)."""

    def __init__(self) -> None:
        self.script: dict[str, Answer] = {}
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _answer_for(self, path: str) -> Answer:
        for prefix, answer in self.script.items():
            if path.startswith(prefix):
                return answer
        return Answer(status=b"HTTP/1.1 404 Not Found", pieces=(b"no",))

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                request = self._read_request(conn)
                if request is not None:
                    self._play(conn, self._answer_for(request))
            except OSError:  # the client went away: that is its right
                pass

    @staticmethod
    def _read_request(conn: socket.socket) -> str | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(
            (int(v) for k, _, v in (ln.partition(":") for ln in lines[1:]) if k.lower() == "content-length"), 0
        )
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            rest += chunk
        parts = lines[0].split(" ")
        return parts[1] if len(parts) > 1 else "/"

    def _play(self, conn: socket.socket, a: Answer) -> None:
        body = b"".join(a.pieces)
        headers = [a.status] if a.status else []
        if a.framing == "length":
            headers.append(b"Content-Length: %d" % len(body))
        elif a.framing == "short_length":
            headers.append(b"Content-Length: %d" % (len(body) + 100))
        elif a.framing in ("chunked", "bad_chunk"):
            headers.append(b"Transfer-Encoding: chunked")
        headers.append(b"Connection: close")
        conn.sendall(b"\r\n".join(headers) + b"\r\n\r\n")
        chunked = a.framing in ("chunked", "bad_chunk")
        for piece in a.pieces:
            self._pause(a.delay_s)
            if chunked and piece:
                piece = b"%x\r\n%s\r\n" % (len(piece), piece)
            conn.sendall(piece)
        if a.endless:
            piece = b"%x\r\n%s\r\n" % (len(a.endless), a.endless) if chunked else a.endless
            end = time.monotonic() + ENDLESS_CAP_S
            while not self._stop.is_set() and time.monotonic() < end:
                conn.sendall(piece)
                self._pause(a.delay_s)
        if a.hang:
            conn.settimeout(0.2)
            end = time.monotonic() + ENDLESS_CAP_S
            while not self._stop.is_set() and time.monotonic() < end:
                try:
                    if conn.recv(1) == b"":
                        return
                except TimeoutError:
                    continue
            return
        if a.framing == "chunked":
            conn.sendall(b"0\r\n\r\n")
        elif a.framing == "bad_chunk":
            conn.sendall(b"zz\r\n")

    def _pause(self, seconds: float) -> None:
        if seconds:
            self._stop.wait(seconds)
