"""The policy client: OpenAIChatPolicy sends tools in the OpenAI form, parses tool calls, reasoning, usage and
extras, retries what is worth retrying and fails clearly otherwise; an episode runs against a local HTTP server."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from k3.env.client import OpenAIChatPolicy, PolicyError, ScriptedPolicy, assistant_message, tool_call
from k3.env.episode import Episode
from k3.env.task import Task, Verdict
from k3.env.toolbox import BUILTIN_TOOLS

TOOLS = [BUILTIN_TOOLS["shell"].spec()]


def _response(message, finish="tool_calls", usage=(11, 7), **choice_extra):
    return {"id": "cmpl-1", "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice_extra}],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]}}


def test_request_and_response_in_openai_form():
    seen = []

    def handler(request):
        seen.append((str(request.url), request.headers.get("authorization"), json.loads(request.content)))
        return httpx.Response(200, json=_response(
            {"role": "assistant", "content": None, "reasoning_content": "list them",
             "tool_calls": [{"id": "call_a", "type": "function",
                             "function": {"name": "shell", "arguments": "{\"command\": \"ls\"}"}}]},
            logprobs={"content": [{"token": "x", "logprob": -0.5}]}, token_ids=[5, 6]))
    p = OpenAIChatPolicy("http://127.0.0.1:9/v1", "k3-tiny", api_key="secret", transport=httpx.MockTransport(handler))
    c = p.complete([{"role": "user", "content": "hi"}], TOOLS, max_tokens=64, temperature=0.5)
    url, auth, body = seen[0]
    assert url == "http://127.0.0.1:9/v1/chat/completions" and auth == "Bearer secret"
    assert body == {"model": "k3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                    "temperature": 0.5, "tools": TOOLS, "tool_choice": "auto"}
    assert c.message == {"role": "assistant", "content": None, "reasoning_content": "list them",
                         "tool_calls": [{"id": "call_a", "type": "function",
                                         "function": {"name": "shell", "arguments": "{\"command\": \"ls\"}"}}]}
    assert c.finish_reason == "tool_calls" and c.usage == {"prompt_tokens": 11, "completion_tokens": 7}
    assert c.extras["token_ids"] == [5, 6] and c.extras["logprobs"]["content"][0]["logprob"] == -0.5
    # without tools, none are sent; a server root without /v1 gets it added
    p2 = OpenAIChatPolicy("http://127.0.0.1:9", "m", transport=httpx.MockTransport(handler))
    p2.complete([], [], max_tokens=1, temperature=0)
    assert seen[1][0].endswith(":9/v1/chat/completions") and "tools" not in seen[1][2]


def test_retries_server_errors_then_succeeds_and_refuses_client_errors():
    statuses = [503, 500, 200]

    def handler(request):
        s = statuses.pop(0)
        return httpx.Response(s, json=_response({"role": "assistant", "content": "ok"}, "stop")) if s == 200 \
            else httpx.Response(s, text="busy")
    p = OpenAIChatPolicy("http://x/v1", "m", retries=3, backoff_s=0, transport=httpx.MockTransport(handler))
    assert p.complete([], [], max_tokens=1, temperature=0).message["content"] == "ok" and statuses == []

    p = OpenAIChatPolicy("http://x/v1", "m", retries=3, backoff_s=0, transport=httpx.MockTransport(
        lambda r: httpx.Response(400, json={"error": {"message": "tools not supported"}})))
    with pytest.raises(PolicyError, match="answered 400: .*tools not supported"):
        p.complete([], TOOLS, max_tokens=1, temperature=0)
    p = OpenAIChatPolicy("http://x/v1", "m", transport=httpx.MockTransport(lambda r: httpx.Response(200, text="{}")))
    with pytest.raises(PolicyError, match="returned no completion"):
        p.complete([], [], max_tokens=1, temperature=0)


def test_unreachable_server_is_a_policy_error():
    p = OpenAIChatPolicy("http://127.0.0.1:1/v1", "m", retries=1, backoff_s=0, timeout=2)
    with pytest.raises(PolicyError, match="cannot reach .* after 2 attempts"):
        p.complete([], [], max_tokens=1, temperature=0)


def test_scripted_policy_fills_ids_and_encodes_arguments():
    p = ScriptedPolicy([assistant_message(None, [{"function": {"name": "shell", "arguments": {"command": "ls"}}}])])
    c = p.complete([], TOOLS, max_tokens=5, temperature=1)
    assert c.message["tool_calls"][0] == {"id": "call_1_0", "type": "function",
                                          "function": {"name": "shell", "arguments": "{\"command\": \"ls\"}"}}
    dup = ScriptedPolicy([assistant_message(None, [tool_call("a", {}, id="x"), tool_call("b", {}, id="x"), "junk"])])
    ids = [c["id"] for c in dup.complete([], [], max_tokens=5, temperature=1).message["tool_calls"]]
    assert ids == ["x", "call_1_1", "call_1_2"]
    with pytest.raises(PolicyError, match="only 1 messages"):
        p.complete([], TOOLS, max_tokens=5, temperature=1)


class _FakeServer(BaseHTTPRequestHandler):
    """Answers chat completions from a script: first a shell call, then a submit of what the shell printed."""
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.requests.append(body)
        last = body["messages"][-1]
        if last["role"] == "user":
            call = tool_call("shell", {"command": "cat n"}, id="c1")
        else:
            call = tool_call("submit", {"answer": last["content"].split("stdout:\n")[1].strip()}, id="c2")
        data = json.dumps(_response({"role": "assistant", "content": None, "tool_calls": [call]})).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_episode_against_a_local_openai_compatible_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        policy = OpenAIChatPolicy(f"http://127.0.0.1:{server.server_address[1]}", "k3", timeout=10)
        task = Task(id="n", family="x", prompt="Submit the number in n.", image={"n": "5\n"},
                    verify=lambda sb, a: Verdict(float(a == "5"), a == "5"))
        traj = Episode(task, "react", policy, sandbox_kind="none").run()
        policy.close()
    finally:
        server.shutdown()
        server.server_close()
    assert traj.success and traj.end_reason == "submitted" and traj.counts["completion_tokens"] == 14
    sent = _FakeServer.requests
    assert [t["function"]["name"] for t in sent[0]["tools"]] == ["python", "shell", "submit"]
    assert sent[1]["messages"][-1]["tool_call_id"] == "c1" and sent[1]["messages"][-2]["tool_calls"][0]["id"] == "c1"
