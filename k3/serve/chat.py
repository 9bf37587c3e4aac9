"""K3's chat template, XTML (report appendix F): how a chat request becomes the prompt, and how the model's output
is read back. This module is the API; the template data lives in chat_template, rendering in chat_render, token
ids and stops in chat_encode, the streaming parser in chat_parse, and the parse of a whole rendering in
chat_conversation.

Markup. Four markers, reserved special tokens of K3's tokenizers: [open], [sep], [close] and [end_of_msg]. An
element is `[open]tag attr="value" ...[sep] body [close]tag[sep]`, XML with the angle brackets replaced by markers.
A message is an element whose body ends with [end_of_msg], the generation stop marker:

    [open]<role tag> attrs[sep]<body>[end_of_msg][close]<role tag>[sep]

The context, in order:
1. Global option messages, `[open]option type="..."[sep]`: type="tool-declare" (the request's `tools`, one compact
   JSON declaration per line), then type="thinking-effort" (`reasoning_effort` low/medium/high/max, as the
   template's natural-language instruction).
2. The input messages (`messages`), OpenAI style:
   - system, user: `[open]system[sep]text...` (content: a string or text parts).
   - assistant: a body of channels, each an element, in this order: `think` (reasoning, the message's
     "reasoning_content" or "reasoning"), `response` (the content), `tools` (the tool calls). Preserved
     thinking: in thinking mode every assistant message keeps its think channel, empty when it had no
     reasoning, and has a response channel when its content is not null; in instruct mode history has no think
     channel and always a response channel (empty for null content).
   - a tool call, inside `tools`: `[open]call tool="NAME" index="I"[sep]ARGS[close]call[sep]`, I numbering the
     message's calls from 0. ARGS: one element per argument, in order: `[open]arg name="KEY"[sep]VALUE[close]arg[sep]`
     with a string VALUE as raw text, and `[open]arg name="KEY" type="json"[sep]...` with any other JSON value
     compact (`json.dumps(v, separators=(",", ":"), ensure_ascii=False)`). When the arguments cannot be cut so
     (not a JSON object, or a key with a double quote or a marker), the pure-JSON fallback block holds them all:
     `[open]json[sep]COMPACT JSON[close]json[sep]`. It occurs in inputs only; SFT masks its loss.
   - tool: `[open]tool tool="NAME" index="I"[sep]result...`, repeating the call's pair. A result's call is the
     one its `tool_call_id` names among the most recent assistant message's calls (or, without an id, the next
     call); results follow call order, each call answered at most once (an error names the message otherwise).
     A tool message with no call before it has no attributes.
   - input option messages, interleaved: {"role": "option", "type": "tool-declare", "tools": [...]} (tools loaded
     mid-session) or {"role": "option", "type": "thinking-effort", "effort": "high"}, rendered like the globals.
3. One-shot option messages: type="tool_choice" ("none", "required" or a named function; "auto" is the default
   and renders nothing; parallel_tool_calls=false adds the single-call instruction), then type="response_format" (json_object, or json_schema with its schema object;
   "text" renders nothing). Each is a short natural-language instruction (ChatTemplate's fields).
4. The generation prompt: `[open]assistant[sep]` and the generation prefix, `[open]think[sep]` (thinking mode)
   or `[open]response[sep]` (instruct mode). The model continues with the message body and ends it with
   [end_of_msg]; the template closes it with `[close]assistant[sep]` in history.

Example (thinking mode; tools=[{"type": "function", "function": {"name": "get_weather", ...}}]; an assistant turn
{"reasoning_content": "Need data.", "content": null, "tool_calls": [{"id": "c1", "function": {"name": "get_weather",
"arguments": '{"city": "Paris", "days": 2}'}}]} and its result {"role": "tool", "tool_call_id": "c1", "content":
"sunny"}), line breaks added:

    [open]option type="tool-declare"[sep]{"type":"function","function":{"name":"get_weather",...}}[end_of_msg]
    [close]option[sep]
    [open]user[sep]Weather in Paris?[end_of_msg][close]user[sep]
    [open]assistant[sep][open]think[sep]Need data.[close]think[sep][open]tools[sep]
    [open]call tool="get_weather" index="0"[sep][open]arg name="city"[sep]Paris[close]arg[sep]
    [open]arg name="days" type="json"[sep]2[close]arg[sep][close]call[sep][close]tools[sep][end_of_msg]
    [close]assistant[sep]
    [open]tool tool="get_weather" index="0"[sep]sunny[end_of_msg][close]tool[sep]
    [open]assistant[sep][open]think[sep]

Escaping. There is none in the text: message text containing "[open]" is kept apart from markup by the
tokenizer. Rendering yields `Segment`s (markers vs text); `encode_segments` / `render_chat_ids` encode each text
run with special-token matching off (K3Tokenizer encodes special-token text as ordinary bytes) and put the
markers' special ids between them, so only the template's own markup gets the special ids. The text form
(`render_chat`) is for display and for tokenizers without the markup (an older checkpoint's): it encodes the
markers as plain text, and there a message containing a marker string can look like markup.

API for serving a request:
    ids = render_chat_ids(messages, tokenizer, template, tools=..., tool_choice=..., response_format=...,
                          reasoning_effort=..., thinking=False)          # ValueError names the bad field
    stop, stop_ids = chat_stop(tokenizer, template)                     # [end_of_msg]'s id, or its string
    parser = AssistantParser(template, prefix="think" if thinking else "response", tokenizer=tokenizer)
    for ev in parser.feed_ids(new_ids) (or parser.feed(decoded_text)), then parser.finish():
        ev.kind in "reasoning", "content", "tool_call_start", "tool_call_arguments", "tool_call_end", "error", "end"
    parser.result() -> ParsedAssistant(reasoning, content, tool_calls=[ToolCall(index, name, arguments)], errors)
    parse_assistant(text_or_segments, template, prefix) -> ParsedAssistant (the same, not streamed)

The template is data, stored with the checkpoint as `chat_template.json` (`save_chat_template`); a checkpoint
without the file uses `DEFAULT_CHAT_TEMPLATE`; a format_version 1 file is upgraded on load or names the migration
(k3.serve.chat_template).
"""

from k3.serve.chat_conversation import parse_conversation
from k3.serve.chat_encode import (chat_stop, encode_segments, markup_ids, render_chat_ids, segment_units,
                                  split_markup, stop_strings)
from k3.serve.chat_parse import AssistantParser, ChatEvent, ParsedAssistant, ToolCall, parse_assistant, parse_tag
from k3.serve.chat_render import Segment, compact_json, message_text, render_chat, render_chat_segments
from k3.serve.chat_template import (CHAT_TEMPLATE_FILE, CHANNELS, DEFAULT_CHAT_TEMPLATE, EFFORT_LEVELS,
                                    FORMAT_VERSION, OPTION_ROLE, ROLES, ChatTemplate, ChatTemplateError,
                                    chat_template_json, load_chat_template, migrate_chat_template,
                                    save_chat_template)

__all__ = ["AssistantParser", "CHANNELS", "CHAT_TEMPLATE_FILE", "ChatEvent", "ChatTemplate", "ChatTemplateError",
           "DEFAULT_CHAT_TEMPLATE", "EFFORT_LEVELS", "FORMAT_VERSION", "OPTION_ROLE", "ParsedAssistant", "ROLES",
           "Segment", "ToolCall", "chat_stop", "chat_template_json", "compact_json", "encode_segments",
           "load_chat_template", "markup_ids", "message_text", "migrate_chat_template", "parse_assistant",
           "parse_conversation", "parse_tag", "render_chat", "render_chat_ids", "render_chat_segments",
           "save_chat_template", "segment_units", "split_markup", "stop_strings"]
