"""A server in this process: the OpenAI-compatible app on a free port of the loopback address, in a thread.

For clients in the same process that talk HTTP anyway (`k3 env run --ckpt` runs its agents against the engine this
way, through exactly the endpoint an outside client uses) and for tests.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", start_timeout: float = 60.0):
    """Serve `app` with uvicorn on a free port of `host` in a daemon thread; yields the port, and stops the server
    (graceful shutdown, lifespan included) on exit. Raises RuntimeError when it does not start in time."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    from k3.serve.http import uvicorn_options

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                                           **uvicorn_options()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        if not server.started:
            raise RuntimeError(f"the in-process server did not start within {start_timeout:g} s")
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
