"""Forwarding one request to a backend, with failover (report §5.4.3: a session's secondary takes over when its
primary fails).

A request goes to the first healthy backend of its order (k3.route.fleet.Fleet.candidates); when that attempt fails
before anything was sent to the client (the connection is refused or lost, or the backend answers 502, 503 or
504), the backend's health is probed and the request is retried once, on the next healthy backend (the session's
secondary). Other answers (200, the backend's own 4xx) are passed through as they are.

Streams (`"stream": true`) are relayed event by event, as each server-sent event arrives, never buffered beyond one
event. The response to the client starts with the first event that carries output; a chat stream's opening event
(the assistant's role alone, which `k3 serve` sends before it has run the prompt) is held back until then, so a
backend that fails during the prefill is retried as if nothing had been sent. Once output has reached the client,
a failure cannot be retried without sending text twice: the stream ends with one OpenAI-shaped error event,
`data: {"error": {"message": ..., "type": "server_error", "param": null, "code": "backend_failed"}}`, and closes
without `data: [DONE]` (the openai client raises an APIError on it; a client that waits for [DONE] sees the stream
end early).

A client that goes away (while its request waits in the admission queue, while a non-streamed answer is being
computed, or mid-stream) has its backend connection closed, and `k3 serve` aborts the request on a closed connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import suppress

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from k3.route.fleet import Backend, Fleet
from k3.route.requests import RoutedRequest
from k3.serve.protocol import error_body, error_response

RETRY_STATUSES = (502, 503, 504)  # a backend that cannot serve now: the request goes to the next one
DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there
DONE = b"data: [DONE]"
BACKEND_HEADER = "X-K3-Backend"  # on every proxied answer: the backend that produced it
PASSED_HEADERS = ("content-type", "retry-after", "www-authenticate")  # of a backend's answer, to the client


class BackendFailed(Exception):
    """An attempt failed before anything reached the client."""


class ClientGone(Exception):
    """The client disconnected while its request waited."""


async def until_disconnect(request: Request, aw):
    """Await `aw`, cancelling it (and raising ClientGone) when the client disconnects first."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await task
                raise ClientGone()
    except asyncio.CancelledError:
        task.cancel()
        raise


def _is_preamble(event: bytes) -> bool:
    """A chat stream's opening event: choices whose delta is the assistant's role alone (no text, no finish)."""
    if not event.startswith(b"data: {"):
        return False
    try:
        obj = json.loads(event[6:])
        choices = obj["choices"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(choices, list) and bool(choices) and not obj.get("usage")
            and all(isinstance(c, dict) and c.get("delta") == {"role": "assistant"} and c.get("finish_reason") is None
                    and not c.get("logprobs") for c in choices))


async def _events(resp: httpx.Response):
    """The server-sent events of `resp`, each whole (ending with a blank line). Raises httpx.RemoteProtocolError
    when the stream ends inside an event."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        while (i := buf.find(b"\n\n")) >= 0:
            yield buf[:i + 2]
            buf = buf[i + 2:]
    if buf.strip():
        raise httpx.RemoteProtocolError("the stream ended inside an event")


class _Relay(StreamingResponse):
    """A streamed answer whose `on_close` runs however the response ends (finished, client gone, error)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


class Proxy:
    """Sends routed requests to the fleet's backends over `client`."""

    def __init__(self, fleet: Fleet, client: httpx.AsyncClient):
        self.fleet, self.client = fleet, client

    async def _failed(self, b: Backend) -> None:
        b.errors += 1
        await self.fleet.check(self.client, b)  # a killed instance is down at once, for every later request

    def _headers(self, request: Request) -> dict:
        h = {"content-type": "application/json"}
        auth = request.headers.get("authorization")
        if auth is not None:
            h["authorization"] = auth
        return h

    @staticmethod
    def _answer(b: Backend, status: int, content: bytes, headers) -> Response:
        out = {k: headers[k] for k in PASSED_HEADERS if k in headers}
        out[BACKEND_HEADER] = b.url
        return Response(content, status_code=status, headers=out)

    # --- one attempt ------------------------------------------------------------------------------------------------
    async def _plain(self, b: Backend, path: str, routed: RoutedRequest, headers: dict) -> Response:
        b.requests += 1
        b.in_flight += 1
        try:
            r = await self.client.post(f"{b.url}{path}", content=routed.raw, headers=headers)
        except httpx.TransportError as e:
            raise BackendFailed(f"{b.url}: {type(e).__name__}") from None
        finally:
            b.in_flight -= 1
        if r.status_code in RETRY_STATUSES:
            raise BackendFailed(f"{b.url}: HTTP {r.status_code}")
        return self._answer(b, r.status_code, r.content, r.headers)

    async def _open_stream(self, b: Backend, path: str, routed: RoutedRequest, headers: dict, on_done):
        """A streamed answer that starts with the backend's first output event, or its error answer."""
        b.requests += 1
        b.in_flight += 1
        resp, events = None, None

        async def close() -> None:
            b.in_flight -= 1
            if events is not None:
                with suppress(Exception):
                    await events.aclose()
            if resp is not None:
                await resp.aclose()  # mid-stream this closes the connection: the backend aborts the request

        try:
            req = self.client.build_request("POST", f"{b.url}{path}", content=routed.raw, headers=headers)
            try:
                resp = await self.client.send(req, stream=True)
                if resp.status_code != 200:
                    content = await resp.aread()
                    if resp.status_code in RETRY_STATUSES:
                        raise BackendFailed(f"{b.url}: HTTP {resp.status_code}")
                    await close()
                    on_done(None)
                    return self._answer(b, resp.status_code, content, resp.headers)
                events = _events(resp)
                held = []
                async for ev in events:
                    held.append(ev)
                    if not _is_preamble(ev):
                        break
            except httpx.TransportError as e:
                raise BackendFailed(f"{b.url}: {type(e).__name__}") from None
        except BaseException:
            await close()
            raise
        first = time.monotonic()

        async def relay():
            finished = False
            try:
                for ev in held:
                    finished = finished or ev.startswith(DONE)
                    yield ev
                async for ev in events:
                    finished = finished or ev.startswith(DONE)
                    yield ev
                if not finished:
                    raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            except httpx.TransportError as e:
                await self._failed(b)
                msg = (f"the backend {b.url} failed after this stream had started ({type(e).__name__}); the output "
                       f"above is all there is: send the request again to get a whole answer")
                err = error_body(msg, "server_error", None, "backend_failed")
                yield f"data: {json.dumps(err)}\n\n".encode()

        async def on_close() -> None:
            await close()
            on_done(first)

        out = {k: resp.headers[k] for k in PASSED_HEADERS if k in resp.headers}
        out[BACKEND_HEADER] = b.url
        return _Relay(relay(), on_close, headers=out, media_type="text/event-stream")

    # --- a request ------------------------------------------------------------------------------------------------
    async def forward(self, request: Request, path: str, routed: RoutedRequest, on_done) -> Response:
        """The answer to `routed` from the fleet. `on_done(first_output_time or None)` is called once, when the
        answer has been sent in full or the request has failed (for a stream: when the stream closes)."""
        primary, order = self.fleet.candidates(routed.session_key)
        if not primary.healthy:
            primary.failovers += 1
        if not order:
            on_done(None)
            return error_response(503, "no backend is healthy; retry later", "server_error",
                                  code="no_healthy_backend", headers={"Retry-After": "1"})
        headers = self._headers(request)
        reasons = []
        tries = order[:2]  # the first choice and one retry
        for i, b in enumerate(tries):
            try:
                if routed.stream:
                    answer = await self._open_stream(b, path, routed, headers, on_done)
                else:
                    answer = await self._plain(b, path, routed, headers)
            except BackendFailed as e:
                reasons.append(str(e))
                await self._failed(b)
                if i + 1 < len(tries):
                    b.retries += 1
                continue
            if b is primary:
                b.affinity_hits += 1
            if not routed.stream:
                on_done(time.monotonic())
            return answer
        on_done(None)
        tried = " and then ".join(reasons)
        return error_response(502, f"the request failed on {tried}; nothing was sent, so it can be sent again",
                              "server_error", code="backend_failed", headers={"Retry-After": "1"})
