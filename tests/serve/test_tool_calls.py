"""Tool calling, reasoning and response formats of the chat endpoint (k3.serve.chat_api).

Server tests: a real uvicorn server in a thread over a random tiny checkpoint (byte tokenizer, whose special ids
257..260 are the chat markup), driven by the official `openai` client. The model's choice of tokens is scripted:
`Script` wraps the loaded model's forward so that, after a prompt of the expected length, the logits of each next
position are one-hot on the next token of a scripted output (then on [end_of_msg]). Everything else is the real
path: rendering, tokenization, engine, sampler (greedy), stop token, parser, reply assembly, HTTP. The expected
prompt length comes from rendering the same request with k3.serve.chat, so a server that built another prompt
would misalign the script and fail.

Unit tests: the reply assembly (parser events -> OpenAI deltas and message) over random well-formed and malformed
outputs (hypothesis): deltas always reassemble to the message, nothing raises, well-formed outputs come back
exactly, malformed ones are reported.
"""

import json
import random
from types import SimpleNamespace

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from helpers import tiny_chat_checkpoint, uvicorn_in_thread
from k3.serve.chat import (AssistantParser, encode_segments, parse_conversation, render_chat_segments,
                           split_markup)
from k3.serve.chat_api import ChatOptions, ReplyAssembler, chat_options, merge_deltas
from k3.serve.chat_schema import check_schema, schema_errors
from k3.serve.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from k3.serve.protocol import APIError

MODEL = "k3-tiny-tools"
HOST = "127.0.0.1"
T = DEFAULT_CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _call(name, index, args_markup):
    return f'[open]call tool="{name}" index="{index}"[sep]{args_markup}[close]call[sep]'


PARIS = '[open]arg name="city"[sep]Paris[close]arg[sep][open]arg name="days" type="json"[sep]2[close]arg[sep]'
THINK_CALL = ("Need data.[close]think[sep][open]tools[sep]" + _call("get_weather", 0, PARIS) +
              "[close]tools[sep][end_of_msg]")


class Script:
    """Scripts the tokens a model writes: after a prompt of `prompt_len` tokens, the next position's logits are
    one-hot on tokens[k] (k: how many tokens were generated), then on `stop_id`. Positions come from the MLA cache
    views the engine passes (their start positions and, packed, lengths)."""

    def __init__(self, model, stop_id: int):
        self.prompt_len, self.tokens, self.stop_id = None, [], stop_id
        inner = model.forward

        def forward(input_ids, cache=None, **kw):
            out = inner(input_ids, cache=cache, **kw)
            if self.prompt_len is None or cache is None:
                return out
            view = next(v for v in cache.layers if hasattr(v, "starts"))
            lengths = view.lengths or [input_ids.shape[1]] * len(view.starts)
            rows = out.logits[0] if view.lengths else out.logits[:, -1]
            for i, (start, n) in enumerate(zip(view.starts, lengths)):
                k = start + n - self.prompt_len
                if k >= 0:
                    rows[i] = -1e4
                    rows[i, self.tokens[k] if k < len(self.tokens) else self.stop_id] = 0.0
            return out

        model.forward = forward

    def play(self, prompt_len: int, tokens: list[int]) -> None:
        self.prompt_len, self.tokens = prompt_len, tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from k3.serve.app import create_app
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig

    model, tok = tiny_chat_checkpoint(tmp_path_factory.mktemp("tools") / "tiny")
    script = Script(model, tok.special_token_id(T.end_of_message))
    cfg = EngineConfig(cache_memory_mb=16, page_tokens=32, hash_block_tokens=16, max_model_len=1024,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_step_tokens=1024, prefill_chunk=1024))
    engine = LLMEngine(model, tok, cfg)
    app = create_app(engine, tok, MODEL)
    with uvicorn_in_thread(app, HOST) as port:
        hc = httpx.Client(trust_env=False, timeout=60)
        client = OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="x", max_retries=0, timeout=60, http_client=hc)
        yield SimpleNamespace(client=client, tok=tok, script=script, http=hc, base=f"http://{HOST}:{port}")
        hc.close()


def _ids(tok, markup: str) -> list[int]:
    return encode_segments(tok, split_markup(markup, T), T)


def _prompt_len(srv, messages, **opts) -> int:
    return len(encode_segments(srv.tok, render_chat_segments(messages, T, **opts), T))


def _chat(srv, output: str, messages=USER, render=None, stream=False, **kw):
    """Script `output` (markup text) after the prompt the request should render (`render`: its options, default
    those of kw) and send the request."""
    if render is None:
        render = {k: kw[k] for k in ("tools", "tool_choice", "response_format", "reasoning_effort",
                                     "parallel_tool_calls") if k in kw}
        render["thinking"] = "reasoning_effort" in kw
    n = _prompt_len(srv, messages, **render)
    srv.script.play(n, _ids(srv.tok, output))
    r = srv.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=stream, **kw)
    return r, n


def _reassemble(chunks):
    """A streamed reply put back together as a client does: (message dict, finish_reason, first call deltas)."""
    m = {"content": None, "reasoning_content": None, "tool_calls": [], "tool_call_errors": [],
         "response_format_errors": []}
    reason, firsts = None, []
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta.model_dump(exclude_none=True)
        for key in ("content", "reasoning_content"):
            if key in d:
                m[key] = (m[key] or "") + d[key]
        for key in ("tool_call_errors", "response_format_errors"):
            m[key] += d.get(key, [])
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(m["tool_calls"]):
                firsts.append(tc)
                m["tool_calls"].append({"id": tc["id"], "type": tc["type"],
                                        "function": {"name": tc["function"]["name"], "arguments": ""}})
            m["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"].get("arguments", "")
        reason = c.finish_reason or reason
    return m, reason, firsts


def _msg(r):
    return r.choices[0].message.model_dump()


# =====================================================================================================================
# Through the server


def test_tool_call_with_reasoning(server):
    r, n = _chat(server, THINK_CALL, tools=[WEATHER, TIME], reasoning_effort="high")
    m, choice = _msg(r), r.choices[0]
    assert r.usage.prompt_tokens == n
    assert choice.finish_reason == "tool_calls"
    assert m["content"] is None and m["reasoning_content"] == "Need data."
    (call,) = m["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) > 12 and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert "tool_call_errors" not in m


def test_streamed_tool_call_reassembles_to_the_same_message(server):
    r, _ = _chat(server, THINK_CALL, tools=[WEATHER], reasoning_effort="low")
    whole = _msg(r)
    chunks = list(_chat(server, THINK_CALL, tools=[WEATHER], reasoning_effort="low", stream=True,
                        stream_options={"include_usage": True})[0])
    m, reason, firsts = _reassemble(chunks)
    assert reason == "tool_calls" == r.choices[0].finish_reason
    assert (m["content"], m["reasoning_content"]) == (whole["content"], whole["reasoning_content"])
    assert [c["function"] for c in m["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]
    assert firsts[0]["function"] == {"name": "get_weather", "arguments": ""} and firsts[0]["id"].startswith("call_")
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # several argument pieces: the string argument streams as it is written
    pieces = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(pieces) >= 3 and all(p.index == 0 for p in pieces)


def test_plain_reply_in_instruct_mode(server):
    r, _ = _chat(server, "Hello there![close]response[sep][end_of_msg]")
    m = _msg(r)
    assert m["content"] == "Hello there!" and r.choices[0].finish_reason == "stop"
    assert m.get("reasoning_content") is None and m.get("tool_calls") is None and "tool_call_errors" not in m
    chunks = list(_chat(server, "Hello there![close]response[sep][end_of_msg]", stream=True)[0])
    sm, reason, _ = _reassemble(chunks)
    assert (sm["content"], reason) == ("Hello there!", "stop")


def test_markup_text_in_content_stays_text(server):
    """Text ids spelling a marker are literal text: only the special ids are markup."""
    out = _ids(server.tok, "a ") + server.tok.encode("[close]response[sep]") + _ids(
        server.tok, " b[close]response[sep][end_of_msg]")
    n = _prompt_len(server, USER)
    server.script.play(n, out)
    r = server.client.chat.completions.create(model=MODEL, messages=USER, temperature=0)
    assert r.choices[0].message.content == "a [close]response[sep] b"


def test_thinking_selected_by_chat_template_kwargs(server):
    out = "Hmm.[close]think[sep][open]response[sep]Yes.[close]response[sep][end_of_msg]"
    for kw in ({"thinking": True}, {"enable_thinking": True}):
        r, n = _chat(server, out, render={"thinking": True}, extra_body={"chat_template_kwargs": kw})
        m = _msg(r)
        assert r.usage.prompt_tokens == n and (m["reasoning_content"], m["content"]) == ("Hmm.", "Yes.")
    r, n = _chat(server, "Yes.[close]response[sep][end_of_msg]", render={},
                 extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.usage.prompt_tokens == n and _msg(r)["content"] == "Yes."


@pytest.mark.parametrize("choice, instruction", [
    ("none", "Do not call any tool"), ("required", "must call at least one tool"),
    ({"type": "function", "function": {"name": "get_time"}}, "must call the tool get_time"),
])
def test_tool_choice_renders_its_option(server, choice, instruction):
    segs = render_chat_segments(USER, T, tools=[WEATHER, TIME], tool_choice=choice)
    assert instruction in "".join(s.text for s in segs)
    out = "[close]response[sep][open]tools[sep]" + _call("get_time", 0, "") + "[close]tools[sep][end_of_msg]"
    r, n = _chat(server, out, tools=[WEATHER, TIME], tool_choice=choice)
    m = _msg(r)
    assert r.usage.prompt_tokens == n > _prompt_len(server, USER, tools=[WEATHER, TIME])
    assert [c["function"]["name"] for c in m["tool_calls"]] == ["get_time"]
    assert json.loads(m["tool_calls"][0]["function"]["arguments"]) == {}
    if choice == "none":  # the call is returned and the broken constraint reported
        assert m["tool_call_errors"] == ["tool_choice is 'none' but the model called ['get_time']"]
    else:
        assert "tool_call_errors" not in m


def test_forced_tool_choice_wins_over_the_model(server):
    """A model that wants to answer in text under tool_choice "required" is decoded into a call (the grammar of
    k3.serve.chat_constrain masks its logits)."""
    r, _ = _chat(server, "No.[close]response[sep][end_of_msg]", tools=[WEATHER, TIME], tool_choice="required")
    m = _msg(r)
    assert r.choices[0].finish_reason == "tool_calls" and "tool_call_errors" not in m
    assert [c["function"]["name"] for c in m["tool_calls"]] in (["get_weather"], ["get_time"])


def test_broken_tool_choice_is_reported():
    """Where nothing constrains the decoding (a speculating engine, a tokenizer without the markup), a reply
    that breaks tool_choice says so."""
    def reply(options, output):
        a = ReplyAssembler(options)
        p = AssistantParser(T, prefix="response")
        a.events(p.feed(output) + p.finish())
        a.finish()
        return a.message()

    no_call = reply(chat_options(T, tools=[WEATHER], tool_choice="required"), "No.[close]response[sep][end_of_msg]")
    assert no_call["tool_call_errors"] == ["tool_choice is 'required' but the model called no tool"]
    named = chat_options(T, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    other = reply(named, THINK_CALL.replace("Need data.[close]think[sep]", "[close]response[sep]"))
    assert other["tool_call_errors"] == ["tool_choice names 'get_time' but the model called ['get_weather']"]
    assert [c["function"]["name"] for c in other["tool_calls"]] == ["get_weather"]


def test_parallel_tool_calls_false(server):
    text = "".join(s.text for s in render_chat_segments(USER, T, tools=[WEATHER], parallel_tool_calls=False))
    assert "Call at most one tool in your next message." in text
    two = ("[close]response[sep][open]tools[sep]" + _call("get_weather", 0, PARIS) +
           _call("get_weather", 1, '[open]arg name="city"[sep]Rome[close]arg[sep]') + "[close]tools[sep][end_of_msg]")
    r, n = _chat(server, two, tools=[WEATHER], parallel_tool_calls=False)
    m = _msg(r)
    assert r.usage.prompt_tokens == n and r.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c["function"]["arguments"])["city"] for c in m["tool_calls"]] == ["Paris", "Rome"]
    assert len({c["id"] for c in m["tool_calls"]}) == 2
    assert m["tool_call_errors"] == ["parallel_tool_calls is false but the model made 2 calls "
                                     "['get_weather', 'get_weather']; all are returned"]
    chunks = list(_chat(server, two, tools=[WEATHER], parallel_tool_calls=False, stream=True)[0])
    sm, reason, firsts = _reassemble(chunks)
    assert [f["index"] for f in firsts] == [0, 1] and sm["tool_call_errors"] == m["tool_call_errors"]
    assert [c["function"] for c in sm["tool_calls"]] == [c["function"] for c in m["tool_calls"]]


def test_malformed_output_is_reported_and_well_formed_calls_kept(server):
    out = ("[close]response[sep][open]tools[sep]" + _call("get_weather", 0, PARIS) +
           _call("get_weather", 1, '[open]arg name="days" type="json"[sep]{two[close]arg[sep]') +
           '[open]call index="2"[sep][close]call[sep][close]tools[sep][open]bogus[sep]lost?[close]bogus[sep]'
           "[end_of_msg]")
    r, _ = _chat(server, out, tools=[WEATHER])
    m = _msg(r)
    assert r.choices[0].finish_reason == "tool_calls"
    args = [json.loads(c["function"]["arguments"]) for c in m["tool_calls"]]
    assert args == [{"city": "Paris", "days": 2}, {"days": "{two"}]  # bad JSON kept as a string, and said so
    errs = m["tool_call_errors"]
    assert len(errs) == 3
    assert "argument 'days' is not valid JSON" in errs[0] and "without a tool" in errs[1] and "'bogus'" in errs[2]
    sm, reason, _ = _reassemble(list(_chat(server, out, tools=[WEATHER], stream=True)[0]))
    assert sm["tool_call_errors"] == errs and reason == "tool_calls"
    assert [c["function"] for c in sm["tool_calls"]] == [c["function"] for c in m["tool_calls"]]


def test_call_cut_by_max_tokens(server):
    # 70 tokens end inside the first argument's tag: the call has started
    r, _ = _chat(server, THINK_CALL, tools=[WEATHER], reasoning_effort="low", max_tokens=70)
    m = _msg(r)
    assert r.choices[0].finish_reason == "length" and m["reasoning_content"] == "Need data."
    assert [c["function"]["name"] for c in m["tool_calls"]] == ["get_weather"]
    assert any("'call' is not closed" in e for e in m["tool_call_errors"])
    # 40 tokens end inside the call's own tag: no call, and the error says where the output stopped
    r, _ = _chat(server, THINK_CALL, tools=[WEATHER], reasoning_effort="low", max_tokens=40)
    m = _msg(r)
    assert m.get("tool_calls") is None and r.choices[0].finish_reason == "length"
    assert any("call tool=" in e and "not ended by [sep]" in e for e in m["tool_call_errors"])
    # a plain reply cut short is no error
    r, _ = _chat(server, "Hello there, a long reply[close]response[sep][end_of_msg]", max_tokens=5)
    assert r.choices[0].finish_reason == "length" and _msg(r)["content"] == "Hello"
    assert "tool_call_errors" not in _msg(r)


def test_user_stop_string_ends_the_parse(server):
    r, _ = _chat(server, "one STOP two[close]response[sep][end_of_msg]", stop=["STOP"])
    assert _msg(r)["content"] == "one " and r.choices[0].finish_reason == "stop"
    sm, reason, _ = _reassemble(list(_chat(server, "one STOP two[close]response[sep][end_of_msg]", stop=["STOP"],
                                           stream=True)[0]))
    assert (sm["content"], reason) == ("one ", "stop")


def test_tool_result_round_trip(server):
    r, _ = _chat(server, THINK_CALL, tools=[WEATHER], reasoning_effort="high")
    call = r.choices[0].message.tool_calls[0]
    msgs = USER + [r.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2, n = _chat(server, "Sunny.[close]think[sep][open]response[sep]Sunny, 21 C.[close]response[sep][end_of_msg]",
                  messages=msgs, tools=[WEATHER], reasoning_effort="high")
    assert r2.usage.prompt_tokens == n
    m = _msg(r2)
    assert (m["content"], m["reasoning_content"], r2.choices[0].finish_reason) == ("Sunny, 21 C.", "Sunny.", "stop")
    text = "".join(s.text for s in render_chat_segments(msgs, T, tools=[WEATHER], reasoning_effort="high"))
    assert '[open]tool tool="get_weather" index="0"[sep]sunny, 21 C[end_of_msg]' in text


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


def test_response_format(server):
    ok = '{"answer": 4}[close]response[sep][end_of_msg]'
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}):
        r, n = _chat(server, ok, response_format=fmt)
        assert r.usage.prompt_tokens == n > _prompt_len(server, USER)
        assert json.loads(_msg(r)["content"]) == {"answer": 4} and "response_format_errors" not in _msg(r)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    r, _ = _chat(server, '{"answer": "four", "x": 1}[close]response[sep][end_of_msg]', response_format=fmt)
    assert _msg(r)["response_format_errors"] == ["$.answer: \"four\" is not of type integer",
                                                 "$: the property 'x' is not allowed (additionalProperties is false)"]
    r, _ = _chat(server, "four[close]response[sep][end_of_msg]", response_format={"type": "json_object"})
    assert "not valid JSON" in _msg(r)["response_format_errors"][0]
    sm, _, _ = _reassemble(list(_chat(server, "four[close]response[sep][end_of_msg]",
                                      response_format={"type": "json_object"}, stream=True)[0]))
    assert sm["response_format_errors"] == _msg(r)["response_format_errors"]


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name"),
    ({"tools": "get_weather"}, "tools", "list"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'auto', 'none', 'required'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "bool"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "['low', 'medium', 'high', 'max']"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"thinking": False}}, "reasoning_effort", "thinking"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs", "true or false"),
    ({"chat_template_kwargs": {"enable_thinking": True, "thinking": False}}, "chat_template_kwargs", "disagree"),
    ({"chat_template_kwargs": {"mode": 1}}, "chat_template_kwargs", "unknown keys ['mode']"),
    ({"response_format": {"type": "xml"}}, "response_format", "'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}},
     "response_format", "schema.type = \"strin\""),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": {"a": 3}}}}},
     "response_format", "schema.properties.a"),
])
def test_bad_parameters_get_400_naming_them(server, extra, param, words):
    r = server.http.post(f"{server.base}/v1/chat/completions", json={"model": MODEL, "messages": USER, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


# =====================================================================================================================
# The assembly, directly


def _assemble(segments, options: ChatOptions, rng: random.Random, engine_reason="stop"):
    """Feed `segments` (the model's output after the prefix) to a parser in random pieces; returns (message,
    finish_reason, deltas, parser)."""
    p = AssistantParser(T, prefix="think" if options.thinking else "response")
    a = ReplyAssembler(options)
    deltas = []
    for s in segments:
        if s.special:
            deltas += a.events(p.feed_marker(s.text))
        else:
            text = s.text
            while text:
                k = rng.randint(1, len(text))
                deltas += a.events(p.feed_text(text[:k]))
                text = text[k:]
    deltas += a.events(p.finish())
    if p.content is not None:
        a.opened_response()
    deltas += a.finish()
    return a.message(), a.finish_reason(engine_reason), merge_deltas(deltas), p


def _sum(deltas, thinking):
    m = {"content": None, "reasoning_content": "" if thinking else None, "tool_calls": [], "tool_call_errors": []}
    for d in deltas:
        for k in ("content", "reasoning_content"):
            if k in d:
                m[k] = (m[k] or "") + d[k]
        m["tool_call_errors"] += d.get("tool_call_errors", [])
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(m["tool_calls"]):
                m["tool_calls"].append({"id": tc["id"], "type": "function",
                                        "function": {"name": tc["function"]["name"], "arguments": ""}})
            m["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"].get("arguments", "")
    return m


def _same(message, summed):
    assert summed["tool_calls"] == message.get("tool_calls", [])
    assert summed["tool_call_errors"] == message.get("tool_call_errors", [])
    assert summed["reasoning_content"] == message.get("reasoning_content")
    content = summed["content"]
    assert (content or None) == (message["content"] or None)


text_st = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
json_st = st.recursive(st.none() | st.booleans() | st.integers(-99, 99) | text_st,
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(text_st, c, max_size=3), max_leaves=6)
names_st = st.sampled_from(["f", "get_weather", "a.b-c"])


@st.composite
def replies(draw):
    thinking = draw(st.booleans())
    calls = draw(st.lists(st.tuples(names_st, st.dictionaries(st.text("abcxyz_", min_size=1, max_size=5), json_st,
                                                                 max_size=3)), max_size=3))
    content = draw(st.none() | text_st) if thinking or calls else draw(text_st)
    m = {"role": "assistant", "content": content}
    if thinking:
        m["reasoning_content"] = draw(text_st)
    if calls:
        m["tool_calls"] = [{"id": f"c{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                           for k, (n, a) in enumerate(calls)]
    return m, thinking


def _output_segments(m, thinking):
    """What the model writes after the generation prefix for the assistant message `m`."""
    segs = render_chat_segments([{"role": "user", "content": "q"}, m], T, add_generation_prompt=False,
                                thinking=thinking)
    start = next(i for i, s in enumerate(segs) if s.message == 1 and s.train)
    end = max(i for i, s in enumerate(segs) if s.special and s.text == T.end_of_message)
    return segs[start:end]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replies(), st.randoms(use_true_random=False))
def test_well_formed_replies_come_back_exactly(case, rng):
    m, thinking = case
    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "get_weather", "a.b-c")]
    opts = ChatOptions(tools=tools, thinking=thinking)
    msg, reason, deltas, _ = _assemble(_output_segments(m, thinking), opts, rng)
    assert "tool_call_errors" not in msg
    assert msg.get("reasoning_content") == m.get("reasoning_content")
    calls = m.get("tool_calls", [])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    want = m["content"] if thinking else (m["content"] or "")
    assert msg["content"] == (None if want == "" and calls else want)
    assert reason == ("tool_calls" if calls else "stop")
    _same(msg, _sum(deltas, thinking))


PIECES = ["[open]", "[sep]", "[close]", "[end_of_msg]", "tools", "response", "think", "bogus", "call",
          'call tool="f" index="0"', 'call tool="g" index="0"', 'call index="1"', 'arg name="x"',
          'arg name="x" type="json"', 'arg name="y" type="xml"', "arg", "json", "{bad", "[1,2]", "hi", " "]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=30), st.booleans(), st.sampled_from(["stop", "length"]),
       st.randoms(use_true_random=False))
def test_any_output_assembles_without_raising_and_reports_what_is_wrong(pieces, thinking, engine_reason, rng):
    segs = split_markup("".join(pieces), T)
    opts = ChatOptions(tools=[{"type": "function", "function": {"name": "f"}}], thinking=thinking,
                       parallel_tool_calls=False)
    msg, reason, deltas, parser = _assemble(segs, opts, rng, engine_reason)
    _same(msg, _sum(deltas, thinking))
    calls = msg.get("tool_calls", [])
    assert all(c["function"]["name"] for c in calls) and len({c["id"] for c in calls}) == len(calls)
    assert all(isinstance(json.loads(c["function"]["arguments"]), (dict, list, str, int, float, bool, type(None)))
               for c in calls)
    named = [c for c in parser.result().tool_calls if c.name]
    assert [c["function"]["arguments"] for c in calls] == [c.arguments for c in named]  # none dropped
    assert set(parser.errors) <= set(msg.get("tool_call_errors", []))
    assert reason == ("tool_calls" if calls and engine_reason == "stop" else engine_reason)


# =====================================================================================================================
# Options and the template's parallel_tool_calls instruction


def test_parallel_tool_calls_round_trips_through_the_rendering():
    for choice in (None, "required", {"type": "function", "function": {"name": "get_time"}}):
        segs = render_chat_segments(USER, T, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
        req = parse_conversation(segs)
        assert req["parallel_tool_calls"] is False and req["tool_choice"] == choice
        again = render_chat_segments(req["messages"], T, tools=req["tools"], tool_choice=req["tool_choice"],
                                     parallel_tool_calls=req["parallel_tool_calls"])
        assert [(s.text, s.special) for s in again] == [(s.text, s.special) for s in segs]
    # nothing to say without tools, or when no tool may be called
    plain = render_chat_segments(USER, T)
    assert render_chat_segments(USER, T, parallel_tool_calls=False) == plain
    assert parse_conversation(plain)["parallel_tool_calls"] is True
    none = render_chat_segments(USER, T, tools=[WEATHER], tool_choice="none")
    assert render_chat_segments(USER, T, tools=[WEATHER], tool_choice="none", parallel_tool_calls=False) == none


def test_template_single_call_instruction_is_optional_and_checked():
    d = T.to_dict()
    del d["tool_choice_instructions"]["single"]
    old = ChatTemplate.from_dict(d)  # a file written before the instruction existed
    assert old.single_call_instruction == T.single_call_instruction
    d["tool_choice_instructions"]["single"] = "One call only."
    assert ChatTemplate.from_dict(d).single_call_instruction == "One call only."
    d["tool_choice_instructions"]["several"] = "x"
    with pytest.raises(ChatTemplateError, match="optionally"):
        ChatTemplate.from_dict(d)


def test_chat_options_select_thinking():
    assert chat_options(T).thinking is False
    assert chat_options(T, reasoning_effort="max").thinking is True
    assert chat_options(T, chat_template_kwargs={"enable_thinking": True}).thinking is True
    o = chat_options(T, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (o.tool_choice, o.named) == ("get_weather", True)
    assert chat_options(T, tools=[WEATHER], tool_choice="auto").tool_choice is None
    with pytest.raises(APIError) as e:
        chat_options(T, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    assert e.value.param == "tool_choice" and "declared: ['get_weather']" in e.value.message


def test_schema_subset():
    s = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}, "tags": {
        "type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}, "required": ["n"]}
    check_schema(s, "s")
    assert schema_errors({"n": 3, "tags": ["a"]}, s) == []
    assert schema_errors({"n": 3.0}, s) == []  # 3.0 is an integer in JSON Schema
    assert schema_errors({"n": -1, "tags": ["c", "a", "b"]}, s) == [
        "$.n: -1 breaks minimum 0", "$.tags: has 3, more than maxItems 2", '$.tags[0]: "c" is not one of ["a", "b"]']
    assert schema_errors({"n": True}, s) == ["$.n: true is not of type integer"]
    assert schema_errors("x", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == [
        "$: matches 0 of the 2 schemas of anyOf"]
    for bad, where in (({"type": 3}, "s.type"), ({"required": "n"}, "s.required"), ({"items": 1}, "s.items"),
                       ({"anyOf": []}, "s.anyOf"), ({"maxItems": -1}, "s.maxItems")):
        with pytest.raises(ValueError, match=where.replace(".", r"\.")):
            check_schema(bad, "s")


# =====================================================================================================================
# Constrained decoding of a forced call (k3.serve.chat_constrain)


def _tools_params(tools):
    return {t["function"]["name"]: list(t["function"].get("parameters", {}).get("properties", {})) for t in tools}


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31), st.booleans(), st.integers(0, 120),
       st.sampled_from([None, "get_time", "get_weather", "get"]))
def test_constraint_makes_any_logits_write_one_parseable_call(seed, thinking, extra, named):
    """Random logits, sampled under the constraint, always give one well-formed call of an allowed tool within
    the budget."""
    from k3.data.tokenizer import K3Tokenizer

    tok = K3Tokenizer.byte_level()
    tools = [WEATHER, TIME, {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "qq": {"type": "array"}, "x": {"type": "number"},
                                         "ok": {"type": "boolean"}, "nothing": {"type": "null"}}}}}]
    opts = chat_options(T, tools=tools, reasoning_effort="low" if thinking else None,
                        tool_choice={"type": "function", "function": {"name": named}} if named else "required")
    probe = opts.constraint(tok, T, 10**6, None)
    budget = probe.min_tokens() + extra
    c = opts.constraint(tok, T, budget, tok.eos_id)
    g = torch.Generator().manual_seed(seed)
    eom = tok.special_token_id(T.end_of_message)
    out = []
    for _ in range(budget):
        logits = torch.randn(tok.vocab_size, generator=g) * 4
        t = int(torch.multinomial(torch.softmax(c.mask(logits), -1), 1, generator=g))
        c.advance(t)
        if t == eom:
            break
        out.append(t)
    assert t == eom and c.active and len(out) < budget
    p = AssistantParser(T, prefix="think" if thinking else "response", tokenizer=tok)
    p.feed_ids(out)
    p.finish()
    r = p.result()
    assert r.errors == [] and len(r.tool_calls) == 1
    call = r.tool_calls[0]
    assert call.name == named if named else call.name in ("get_weather", "get_time", "get")
    args = json.loads(call.arguments)
    assert set(args) <= set(_tools_params(tools)[call.name])
    schema = next(t for t in tools if t["function"]["name"] == call.name)["function"]["parameters"]
    kinds = {k: v["type"] if v["type"] != "array" else "string" for k, v in schema["properties"].items()}
    assert schema_errors(args, {"properties": {k: {"type": v} for k, v in kinds.items()}}) == []  # typed values


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("named", [None, "get_weather"])
def test_random_model_under_a_forced_tool_choice_always_calls(server, thinking, named):
    """The random model itself (no script) through the server: every reply is one parseable call."""
    server.script.play(None, [])
    choice = {"type": "function", "function": {"name": named}} if named else "required"
    extra = {"chat_template_kwargs": {"thinking": thinking}}
    for seed in range(2):
        kw = dict(model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0,
                  seed=seed, max_tokens=70 + 40 * seed, extra_body=extra)
        r = server.client.chat.completions.create(**kw)
        m = _msg(r)
        assert "tool_call_errors" not in m, m
        assert r.choices[0].finish_reason == "tool_calls" and len(m["tool_calls"]) == 1
        call = m["tool_calls"][0]["function"]
        assert call["name"] == named if named else call["name"] in ("get_weather", "get_time")
        args = json.loads(call["arguments"])
        assert set(args) <= set(_tools_params([WEATHER, TIME])[call["name"]])
        assert isinstance(args.get("days", 0), int) and isinstance(args.get("city", ""), str)
        sm, reason, _ = _reassemble(list(server.client.chat.completions.create(stream=True, **kw)))
        assert reason == "tool_calls" and [c["function"] for c in sm["tool_calls"]] == [call]
    r = server.http.post(f"{server.base}/v1/chat/completions", json={
        "model": MODEL, "messages": USER, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "shortest one takes" in r.json()["error"]["message"]


def test_reply_of_a_tokenizer_without_the_markup():
    """An older tokenizer has no markup ids: markers are text, the server stops on the end-of-message string (the
    engine cuts the text there) and the parser reads the markers from the decoded text."""
    from k3.data.tokenizer import K3Tokenizer
    from k3.serve.chat_api import ChatTurn

    class Plain:  # encode and decode only: no special_token_id
        def __init__(self):
            self.tok = K3Tokenizer.byte_level()

        def encode(self, text):
            return self.tok.encode(text)

        def decode(self, ids):
            return self.tok.decode(ids)

    tok = Plain()
    out = '[close]response[sep][open]tools[sep]' + _call("get_time", 0, "") + "[close]tools[sep]"
    turn = ChatTurn(chat_options(T, tools=[TIME]), T, tok, stops=True)
    ids = tok.encode(out + "[end_of_msg]")
    deltas = turn.update(ids[:10], out[:10]) + turn.update(ids[10:], out, True, "stop")
    m = turn.message()
    assert m["content"] is None and "tool_call_errors" not in m and turn.finish_reason("stop") == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] == [("get_time", "{}")]
    assert _sum(deltas, False)["tool_calls"] == m["tool_calls"]
