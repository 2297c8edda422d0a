"""Tool calls in chat, for both template families (Hermes/Qwen <tool_call> tags, Llama 3.x JSON): tools and
the tool-call history rendered through the template, the model's calls parsed back into tool_calls."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from pt2serve.serve.app import create_app
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.tool_calls import HERMES, LLAMA3_JSON, ToolCallStream, ToolUse, parse, template_format
from pt2serve.tokenizer import Tokenizer
from servers import ServerThread

pytest.importorskip("xgrammar")

# Condensed from the Qwen 2.5 and Llama 3.1 chat templates: how each writes tools, calls and results. Role
# markers are shortened ([user] for <|im_start|>user, ...) to fit the test artifact's 256-token context with a
# byte-level tokenizer; what these tests are about is kept as the real templates write it.
HERMES_TEMPLATE = """{%- if tools %}<tools>{% for tool in tools %}{{ tool.function.name }}: {{ tool.function.description | tojson }}
{% endfor %}</tools>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}[assistant]
{% for tool_call in message.tool_calls %}<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>{% endfor %}
{% elif message.role == "tool" %}[user]<tool_response>{{ message.content }}</tool_response>
{% else %}[{{ message.role }}]{{ message.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}[assistant]
{% endif %}"""

LLAMA3_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "user" and tools and loop.first %}[user]{% for t in tools %}{{ t.function.name }}: {{ t.function.description | tojson }}
{% endfor %}{{ message.content }}
{%- elif message.tool_calls %}[assistant]<|python_tag|>{% for tool_call in message.tool_calls %}{"name": "{{ tool_call.function.name }}", "parameters": {{ tool_call.function.arguments | tojson }}}{% endfor %}
{%- elif message.role == "tool" %}[ipython]{{ message.content }}
{%- else %}[{{ message.role }}]{{ message.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}[assistant]{% endif %}"""

TEMPLATES = {HERMES: HERMES_TEMPLATE, LLAMA3_JSON: LLAMA3_TEMPLATE}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "<city> & days",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "description": "now",
                                           "parameters": {"type": "object", "properties": {}}}}]
# What each family's model writes for one call (forced below with guided_regex, as the tiny model writes noise).
CALL_TEXT = {HERMES: 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}'
                     '\n</tool_call>',
             LLAMA3_JSON: '{"name": "weather", "parameters": {"city": "Paris", "days": 2}}'}


def test_template_families_are_recognised():
    assert template_format(HERMES_TEMPLATE) == HERMES
    assert template_format(LLAMA3_TEMPLATE) == LLAMA3_JSON
    assert template_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert template_format(None) is None


NAMES = {"weather", "time"}


@pytest.mark.parametrize("family,text,content,calls", [
    (HERMES, CALL_TEXT[HERMES], "Let me check.", [("weather", {"city": "Paris", "days": 2})]),
    (HERMES, '<tool_call>{"name": "time", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "weather", '
             '"arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>', None,
     [("time", {}), ("weather", {"city": "Rome"})]),
    (HERMES, "No tools needed: 4.", "No tools needed: 4.", []),
    (HERMES, '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>', []),  # not one of the tools
    (HERMES, '<tool_call>{"name": "time", "arguments": {', '<tool_call>{"name": "time", "arguments": {', []),
    (LLAMA3_JSON, CALL_TEXT[LLAMA3_JSON], None, [("weather", {"city": "Paris", "days": 2})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "time", "parameters": {}}; {"name": "weather", "parameters": '
                  '{"city": "a;b"}}', None, [("time", {}), ("weather", {"city": "a;b"})]),
    (LLAMA3_JSON, "It is sunny.", "It is sunny.", []),
    (LLAMA3_JSON, '{"answer": 4}', '{"answer": 4}', []),
])
def test_replies_parse_into_calls_whole_and_streamed(family, text, content, calls):
    got_content, got_calls = parse(family, text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)
    stream = ToolCallStream(family)
    sent = "".join(stream.feed(char) for char in text)  # one character at a time
    rest, streamed_calls = stream.finish(ToolUse(family, TOOLS, "auto"))
    assert [(c.name, json.loads(c.arguments)) for c in streamed_calls] == calls
    assert (sent + rest).strip() == (content or "").strip()
    assert "<tool_call" not in sent and "{" not in sent[:1]


@pytest.fixture(params=[HERMES, LLAMA3_JSON])
def family_server(request, chunked_runner, monkeypatch):
    """The tiny model served with a chat template of the family."""
    files = dataclasses.replace(chunked_runner.tokenizer.files, chat_template=TEMPLATES[request.param])
    monkeypatch.setattr(chunked_runner, "tokenizer", Tokenizer(files))
    thread = ServerThread(create_app(ServerConfig(model_name="tiny"), chunked_runner)).start()
    yield request.param, thread.url, chunked_runner.tokenizer
    thread.stop()


def chat(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)  # no max_tokens: to the end
    assert response.status_code == 200, response.text
    return response.json()


def stream_chat(url: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"stream": True, **body},
                      timeout=120) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


ASK = [{"role": "user", "content": "Paris?"}]


def test_forced_calls_follow_the_tools_schemas(family_server):
    _, url, _ = family_server
    jsonschema = pytest.importorskip("jsonschema")
    named = chat(url, messages=ASK, tools=TOOLS, temperature=1.0, seed=3,
                 tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = named["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)

    required = chat(url, messages=ASK, tools=TOOLS, temperature=1.0, seed=4, tool_choice="required",
                    parallel_tool_calls=False)
    calls = required["choices"][0]["message"].get("tool_calls")
    assert calls, json.dumps(required)
    assert len(calls) == 1 and calls[0]["function"]["name"] in NAMES
    if calls[0]["function"]["name"] == "weather":
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)


def test_auto_reads_the_models_call_whole_and_streamed(family_server):
    family, url, _ = family_server
    forced = {"guided_regex": _regex(CALL_TEXT[family]), "temperature": 0}
    whole = chat(url, messages=ASK, tools=TOOLS, **forced)["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert whole["message"]["content"] == ("Let me check." if family == HERMES else None)

    chunks = stream_chat(url, messages=ASK, tools=TOOLS, **forced)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    streamed = [tc for d in deltas for tc in d["delta"].get("tool_calls", [])]
    assert content.strip() == (whole["message"]["content"] or "")
    assert [(tc["index"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in streamed] == \
        [(0, "weather", {"city": "Paris", "days": 2})]
    assert deltas[-1]["finish_reason"] == "tool_calls"

    plain = chat(url, messages=ASK, tools=TOOLS, tool_choice="none", **forced)["choices"][0]
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]  # not read as a call


def test_history_with_calls_and_results_goes_through_the_template(family_server):
    family, url, tokenizer = family_server
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    done = chat(url, messages=history, tools=TOOLS, max_tokens=2, temperature=0)
    rendered_messages = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                          "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}]
    prompt = tokenizer.render_chat(rendered_messages, TOOLS)
    assert '{"city": "Paris", "days": 2}' in prompt and "sunny, 21 C" in prompt  # arguments as objects
    assert '"<city> & days"' in prompt  # tojson as transformers renders it: no HTML escapes
    assert done["usage"]["prompt_tokens"] == len(tokenizer.encode_chat(rendered_messages, TOOLS))


def _regex(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else ("\\n" if c == "\n" else c) for c in text)
