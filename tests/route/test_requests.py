"""What the router reads of a request (k3.route.requests): the session key (header, then `user`, then the prompt's
first characters, which the turns of one conversation share), the prompt-token estimate that picks the class, and
malformed bodies refused with a 400 that names the field."""

import json

import pytest

from k3.route.requests import CHAT_MARKUP_TOKENS, KeyOptions, parse_request
from k3.serve.protocol import APIError

OPTS = KeyOptions(session_header="X-Session-Id", prefix_chars=32, bytes_per_token=1.0)


def _parse(body, chat=False, headers=None, opts=OPTS):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(raw, chat, headers or {}, opts)


def test_session_key_precedence():
    body = {"model": "m", "prompt": "p" * 50, "user": "alice"}
    assert _parse(body, headers={"X-Session-Id": "s1"}).session_key == "session:s1"
    r = _parse(body)
    assert (r.session_key, r.key_source) == ("user:alice", "user")
    r = _parse({"model": "m", "prompt": "p" * 50})
    assert (r.session_key, r.key_source) == ("prompt:" + "p" * 32, "prompt")


def test_turns_of_a_conversation_share_the_prompt_key():
    first = "You are a helpful assistant. Answer in one line. Q1?"
    turns = [first, first + " A1. Q2?", first + " A1. Q2? A2. Q3?"]
    keys = {_parse({"model": "m", "prompt": p}).session_key for p in turns}
    assert len(keys) == 1
    msgs = [{"role": "system", "content": "Be brief and exact, always."}, {"role": "user", "content": "Hello"}]
    grown = msgs + [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "More"}]}]
    a, b = (_parse({"model": "m", "messages": m}, chat=True) for m in (msgs, grown))
    assert a.session_key == b.session_key == "prompt:" + "system\nBe brief and exact, always.\nuser\nHello\n"[:32]
    other = _parse({"model": "m", "messages": [{"role": "user", "content": "Hello"}]}, chat=True)
    assert other.session_key != a.session_key
    ids = _parse({"model": "m", "prompt": list(range(40))})
    assert ids.session_key == "prompt:" + ",".join(map(str, range(32)))


def test_prompt_token_estimate():
    assert _parse({"model": "m", "prompt": "héllo"}).prompt_tokens == 6  # UTF-8 bytes at 1 byte per token
    four = KeyOptions(bytes_per_token=4.0)
    assert _parse({"model": "m", "prompt": "x" * 10}, opts=four).prompt_tokens == 3  # rounded up
    assert _parse({"model": "m", "prompt": [5, 6, 7]}).prompt_tokens == 3
    chat = _parse({"model": "m", "messages": [{"role": "user", "content": "abcd"}, {"role": "user",
                                                                                   "content": None}]}, chat=True)
    assert chat.prompt_tokens == 4 + 2 * CHAT_MARKUP_TOKENS
    assert _parse({"model": "m", "prompt": "x", "stream": True}).stream is True


MALFORMED = [
    (False, b"{not json", None, "not valid JSON"),
    (False, b"[1, 2]", None, "must be a JSON object"),
    (False, b'{"model": "m", "prompt": "x", "temperature": NaN}', None, "NaN is not a JSON number"),
    (False, {"prompt": "x"}, "model", "'model' is a required field"),
    (False, {"model": "m"}, "prompt", "'prompt' is a required field"),
    (False, {"model": 3, "prompt": "x"}, "model", "'model'"),
    (False, {"model": "m", "prompt": 3}, "prompt", "prompt must be a string or a list of integer token ids"),
    (False, {"model": "m", "prompt": ""}, "prompt", "must not be empty"),
    (False, {"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens", "'max_tokens'"),
    (False, {"model": "m", "prompt": "x", "stream": "yes"}, "stream", "'stream'"),
    (False, {"model": "m", "prompt": "x", "temperature": 9}, "temperature", "'temperature'"),
    (True, {"model": "m"}, "messages", "'messages' is a required field"),
    (True, {"model": "m", "messages": "hi"}, "messages", "messages must be a list"),
    (True, {"model": "m", "messages": []}, "messages", "at least one message"),
    (True, {"model": "m", "messages": ["hi"]}, "messages[0]", "must be an object"),
    (True, {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role", "'messages[0].role' is a required"),
    (True, {"model": "m", "messages": [{"role": 1, "content": "x"}]}, "messages[0].role", "must be a string"),
    (True, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string"),
]


@pytest.mark.parametrize("chat,body,param,message", MALFORMED)
def test_malformed_bodies_are_refused_naming_the_field(chat, body, param, message):
    with pytest.raises(APIError) as e:
        _parse(body, chat=chat)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert e.value.param == param and message in e.value.message, e.value.message
