"""The HTTP connection layer of `k3 serve`: uvicorn's h11 protocol with a read timeout and OpenAI-shaped errors for
what never reaches the app.

uvicorn answers a request it cannot parse (bad request line, headers, chunked framing, a Content-Length that does
not parse) with a plain-text 400 of its own, and it has no timeout for a request being read: a client that sends
part of a head, or a body shorter than its Content-Length, holds the connection (and its buffers) until it goes
away; `timeout_keep_alive` only covers the gap between requests. `K3H11Protocol` (passed to uvicorn as its `http`
protocol class) answers both in the API's error shape, {"error": {"message", "type", "param", "code"}}:

- malformed framing: 400, type invalid_request_error, code "malformed_http_request", then the connection closes
  (h11 cannot resynchronize a stream it failed to parse);
- no byte of an incomplete request (head or body) for `read_timeout_s`: 408, code "request_timeout", then the
  connection closes; the app's handler, if it was reading the body, sees the client as disconnected.

What this cannot do (uvicorn's h11 protocol does not allow it without re-implementing it): tell which framing error
it was (uvicorn's handler drops h11's exception before the response is written), answer a request whose head is
larger than h11's limit (h11_max_incomplete_event_size, 16 KiB by default) otherwise than as malformed, and bound a
request's total time: a client that trickles a byte inside every `read_timeout_s` is served as a slow one. The
httptools protocol (uvicorn's default when httptools is installed) is not used: the server always runs h11.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

READ_TIMEOUT_S = 30.0  # no byte of an incomplete request for this long: 408, connection closed
KEEP_ALIVE_S = 5  # uvicorn's timeout_keep_alive: an idle kept-alive connection is closed after this


def _error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode("utf-8")
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode("ascii")
    return head + body


class K3H11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read timeout and JSON errors for framing problems (see the module docstring)."""

    read_timeout_s = READ_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._read_timer = None
        super().connection_made(transport)
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm_read_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_read_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._disarm_read_timer()
        if self.transport.is_closing():
            return
        self.transport.write(_error_bytes(
            400, "Bad Request", "malformed HTTP request: the request line, a header, the chunked encoding or the "
            "Content-Length could not be parsed", "malformed_http_request"))
        self.transport.close()

    # --- the read timeout ---------------------------------------------------------------------------------------
    def _disarm_read_timer(self) -> None:
        t = getattr(self, "_read_timer", None)
        if t is not None:
            t.cancel()
            self._read_timer = None

    def _reading(self) -> bool:
        """Whether a request is being read: its body incomplete, or bytes of a head buffered, or a new connection
        that has sent nothing yet (an idle kept-alive connection is uvicorn's keep-alive timer's)."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return True
        if state is h11.IDLE:
            return bool(self.conn.trailing_data[0]) or self.cycle is None
        return False

    def _arm_read_timer(self) -> None:
        self._disarm_read_timer()
        if self.transport is not None and not self.transport.is_closing() and self._reading():
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or not self._reading():
            return
        cycle = self.cycle
        started = cycle is not None and self.conn.their_state is h11.SEND_BODY and cycle.response_started
        if cycle is not None and self.conn.their_state is h11.SEND_BODY:
            cycle.disconnected = True  # the handler reading the body sees the client gone; its response is dropped
            cycle.message_event.set()
        if not started and (self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]):
            self.transport.write(_error_bytes(
                408, "Request Timeout", f"the request was not received in time: no byte of it came for "
                f"{self.read_timeout_s:g} s (a body shorter than its Content-Length, or a head cut off)",
                "request_timeout"))
        self.transport.close()


def uvicorn_options(read_timeout_s: float | None = None) -> dict:
    """The keyword arguments of uvicorn.run / uvicorn.Config that every k3 server passes: the protocol above and
    the keep-alive timeout. `read_timeout_s`: another read timeout (a subclass of K3H11Protocol with it)."""
    proto = K3H11Protocol
    if read_timeout_s is not None and read_timeout_s != K3H11Protocol.read_timeout_s:
        proto = type("K3H11Protocol", (K3H11Protocol,), {"read_timeout_s": float(read_timeout_s)})
    return {"http": proto, "timeout_keep_alive": KEEP_ALIVE_S}
