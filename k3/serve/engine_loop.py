"""The engine loop: one background thread owns the engine; HTTP handlers talk to it through queues."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass


from k3.serve.engine import RequestOutput
from k3.serve.sampling import SamplingParams
from k3.serve.sequence import Status

logger = logging.getLogger("k3.serve")


# =====================================================================================================================
# The engine loop


@dataclass
class Failure:
    """Delivered instead of a RequestOutput when a request cannot complete."""
    status: int
    message: str
    type: str = "server_error"


class RequestHandle:
    """A submitted request as its HTTP handler sees it: outputs (RequestOutput or Failure) arrive on `queue`."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 loop: asyncio.AbstractEventLoop, images: list | None = None):
        self.request_id, self.prompt_ids, self.params, self.loop = request_id, prompt_ids, params, loop
        self.images = images  # the prompt's images (k3.serve.sequence.PromptImage), or None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seq = None  # the engine's Sequence, set (by the engine thread) before the first output is delivered
        self.finished = False  # set by the handler once it has consumed the final output
        self.checked_at = time.monotonic()  # when the handler last checked that its client is still connected


class EngineLoop:
    """Runs `engine.step()` in one background thread while the engine has work.

    `submit()` and `abort()` may be called from any thread (typically the event loop's): they queue the change and
    wake the thread, which applies it between two steps. Outputs go to each request's asyncio.Queue through its
    event loop's `call_soon_threadsafe`."""

    def __init__(self, engine, idle_wait_s: float = 1.0):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._mutex = threading.Lock()
        self._to_add: deque[RequestHandle] = deque()
        self._to_abort: deque[str] = deque()
        self._active: dict[str, RequestHandle] = {}  # owned by the engine thread
        self._thread: threading.Thread | None = None
        self.fatal: BaseException | None = None
        self.steps = 0
        self.step_failures = 0
        self.aborted = 0
        self.rejected = 0

    # --- control (any thread) -------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._mutex:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping.clear()
            self.fatal = None
            self._thread = threading.Thread(target=self._run, name="k3-engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               images: list | None = None) -> RequestHandle:
        """Queue a request (`images`: its PromptImages); call from a running event loop (the outputs are delivered
        to it)."""
        h = RequestHandle(request_id or f"req-{uuid.uuid4().hex}", list(prompt_ids), params,
                          asyncio.get_running_loop(), images)
        with self._mutex:
            self._to_add.append(h)
        self.start()
        self._wake.set()
        return h

    def abort(self, request_id: str) -> None:
        """Stop a request and free its cache; a no-op for a finished or unknown request."""
        with self._mutex:
            self._to_abort.append(request_id)
        self._wake.set()

    # --- the engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                self._apply_changes()
                if not self.engine.has_work():
                    self._wake.wait(self.idle_wait_s)
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # keep serving: fail the requests in flight, free their pages
                    self.step_failures += 1
                    logger.exception("engine step failed; failing %d request(s)", len(self._active))
                    self._fail_all(Failure(500, f"the engine failed: {type(e).__name__}: {e}"))
                    continue
                self.steps += 1
                for out in outputs:
                    self._deliver_output(out)
                self._reap()
        except BaseException as e:  # a bug in this loop: record it so /health reports it, and fail everyone
            self.fatal = e
            logger.exception("the engine loop stopped")
        finally:
            self._apply_changes(adds_allowed=False)
            self._fail_all(Failure(503, "the server is shutting down" if self.fatal is None else
                                   f"the engine loop stopped: {type(self.fatal).__name__}: {self.fatal}"))

    def _apply_changes(self, adds_allowed: bool = True) -> None:
        with self._mutex:
            adds, self._to_add = list(self._to_add), deque()
            aborts, self._to_abort = set(self._to_abort), deque()
        for h in adds:
            if h.request_id in aborts:
                continue  # the client left before the request reached the engine
            if not adds_allowed:
                self._send(h, Failure(503, "the server is shutting down"))
                continue
            try:
                if h.images:
                    h.seq = self.engine.add_request(h.prompt_ids, h.params, request_id=h.request_id, images=h.images)
                else:
                    h.seq = self.engine.add_request(h.prompt_ids, h.params, request_id=h.request_id)
            except ValueError as e:
                self.rejected += 1
                self._send(h, Failure(400, str(e), "invalid_request_error"))
                continue
            except Exception as e:
                logger.exception("add_request failed")
                self._send(h, Failure(500, f"could not add the request: {type(e).__name__}: {e}"))
                continue
            self._active[h.request_id] = h
        for rid in aborts:
            if self._active.pop(rid, None) is not None:
                try:
                    self.engine.abort_request(rid)
                    self.aborted += 1
                except Exception:
                    logger.exception("abort_request(%s) failed", rid)

    def _deliver_output(self, out: RequestOutput) -> None:
        h = self._active.get(out.request_id)
        if h is None:
            return
        if out.finished:
            del self._active[out.request_id]
        self._send(h, out)

    def _reap(self) -> None:
        """Requests the engine finished without a final output (e.g. one that cannot fit even an empty cache)."""
        for rid, h in list(self._active.items()):
            seq = h.seq
            if seq is None or seq.status != Status.FINISHED:
                continue
            del self._active[rid]
            reason = seq.finish_reason or "error"
            if reason in ("stop", "length"):
                self._send(h, RequestOutput(rid, [], "", True, reason))
            elif "does not fit" in reason:
                self._send(h, Failure(400, f"the request (prompt {len(seq.prompt_ids)} tokens + max_tokens "
                                           f"{seq.params.max_tokens}) does not fit in the server's KV cache; lower "
                                           f"max_tokens or shorten the prompt", "invalid_request_error"))
            else:
                self._send(h, Failure(500, f"the request ended: {reason}"))

    def _fail_all(self, failure: Failure) -> None:
        for rid, h in list(self._active.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort_request(%s) failed", rid)
            self._send(h, failure)
        self._active.clear()

    @staticmethod
    def _send(h: RequestHandle, item) -> None:
        try:
            h.loop.call_soon_threadsafe(h.queue.put_nowait, item)
        except RuntimeError:  # the handler's event loop is closed: nobody is listening
            pass
