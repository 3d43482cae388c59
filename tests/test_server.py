"""grammar_mlx.server live: two real servers (embedded SmolLM2, with and without a truncated draft) in
subprocesses on free loopback ports, driven by the real `openai` client, and the server in process
with faults injected. The unit tests of the package's modules are in tests/server/."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
from conftest import Server

from grammar_mlx import server
from grammar_mlx.models import logits_width_of
from grammar_mlx.server import error_response

REPO = Path(__file__).resolve().parent.parent


# --- live servers ----------------------------------------------------------------------------------

COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
         "required": ["color", "ok"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Reply with a JSON object: a color and whether it is ok."}]


@pytest.fixture
def servers(smollm_servers):
    """The session's plain and draft SmolLM2 servers (tests/conftest.py)."""
    return smollm_servers


def on_each(servers, ask, names=("plain", "draft")):
    """`ask(server)` on each named server at once: {name: its answer}. The servers are separate
    processes, each decoding on its own core; each still sees its requests in the same order."""
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {name: pool.submit(ask, servers[name]) for name in names}
        return {name: future.result() for name, future in futures.items()}


def schema_format(schema, strict=True, name="out"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def chat(client, response_format, *, max_tokens=40, messages=ASK, **kw):
    return client.chat.completions.create(model="smollm", messages=messages, max_tokens=max_tokens,
                                          response_format=response_format, **kw)


def stream_chat(client, response_format, *, max_tokens=40, messages=ASK, **kw):
    chunks = list(client.chat.completions.create(
        model="smollm", messages=messages, max_tokens=max_tokens, response_format=response_format, stream=True,
        stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    return text, finish, usage


@pytest.mark.slow
def test_json_schema_non_streaming(servers):
    reply = chat(servers["plain"].client(), schema_format(COLOR))
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), COLOR)
    assert reply.model == "smollm"  # echoed, not loaded
    assert reply.usage.completion_tokens <= 40


@pytest.mark.slow
def test_json_schema_streaming(servers):
    text, finish, usage = stream_chat(servers["plain"].client(), schema_format(COLOR, strict=False))
    jsonschema.validate(json.loads(text), COLOR)
    assert finish == ["stop"]
    assert len(usage) == 1 and usage[0].completion_tokens >= 3


@pytest.mark.slow
def test_json_schema_with_draft_model(servers):
    client = servers["draft"].client()
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer",
              "minimum": 0, "maximum": 9}}, "required": ["answer", "n"]}
    reply = chat(client, schema_format(schema), extra_body={"num_draft_tokens": 3})  # overrides the CLI
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    text, finish, _ = stream_chat(client, schema_format(COLOR))
    jsonschema.validate(json.loads(text), COLOR)
    assert finish == ["stop"]


NAME_AGE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["name", "age"], "additionalProperties": False}
COLORS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 3, "maxItems": 3}


def answer_sequence(server) -> list[tuple]:
    """The same mixed requests in the same order: per prompt two schemas and one unconstrained,
    chat and completions, streamed and not (greedy; the server's default temperature is 0)."""
    client = server.client()
    answers = []
    for topic in ("a coffee drink and an age", "three colors"):
        messages = [{"role": "user", "content": f"Say {topic}, as JSON."}]
        reply = chat(client, schema_format(NAME_AGE), max_tokens=10, messages=messages)
        answers.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
        answers.append(stream_chat(client, schema_format(COLORS), max_tokens=10, messages=messages)[:2])
        if topic == "three colors":
            reply = client.completions.create(model="smollm", prompt=f"Say {topic}:", max_tokens=8)
            answers.append((reply.choices[0].text, reply.choices[0].finish_reason))
        else:
            reply = chat(client, None, max_tokens=8, messages=messages)
            answers.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
    return answers


@pytest.mark.slow
def test_draft_answers_exactly_what_no_draft_answers_across_a_request_sequence(servers):
    # mlx-lm's speculative path stored prompt caches whose keys named tokens the KV cache did not
    # hold; the next request reusing one lost a token of its context and answered differently.
    answers = on_each(servers, answer_sequence)
    plain, draft = answers["plain"], answers["draft"]
    for i, (a, b) in enumerate(zip(plain, draft)):
        assert a == b, (i, a, b)
    assert not any(text.startswith("<|im_start|>") for text, _ in draft)


@pytest.mark.slow
def test_a_prompt_equal_to_a_cached_prompt_and_answer_is_served(servers):
    # Such a prompt is an exact prompt-cache hit with nothing left to process: mlx-lm's batch path
    # killed its generation thread on it (every later request failed), its speculative path failed it.
    def ask(served):
        client = served.client()
        first = client.completions.create(model="smollm", prompt="Once upon a time", max_tokens=4)
        again = client.completions.create(model="smollm", prompt="Once upon a time" + first.choices[0].text,
                                          max_tokens=4)
        assert again.usage.completion_tokens == 4, served.name
        assert chat(client, None, max_tokens=2).usage.completion_tokens <= 2  # still serving

    on_each(servers, ask)


@pytest.mark.slow
def test_json_object(servers):
    reply = chat(servers["plain"].client(), {"type": "json_object"}, max_tokens=40,
                 messages=[{"role": "user", "content": "Give a JSON object with one short field."}])
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # an open-ended object may outrun the budget: then it says so, and the text is an object's prefix
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


@pytest.mark.slow
def test_regex_extension_on_text_completions(servers):
    client = servers["plain"].client()
    reply = client.completions.create(model="smollm", prompt="Is the sky blue? Answer yes or no:", max_tokens=10,
                                      extra_body={"response_format": {"type": "regex", "regex": "(yes|no)"}})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text in ("yes", "no")


@pytest.mark.slow
def test_text_format_is_unconstrained(servers):
    reply = chat(servers["plain"].client(), {"type": "text"}, max_tokens=5)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens <= 5


@pytest.mark.slow
def test_budget_ending_before_the_grammar_says_length(servers):
    # With length-safe decoding off for the request: the budget ends the output, as before.
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 30, "maxLength": 40}},
              "required": ["s"]}
    off = {"length_safe": False}
    reply = chat(servers["plain"].client(), schema_format(schema), max_tokens=4, extra_body=off)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 4
    head = '{"s":"'
    assert choice.message.content[: len(head)] == head[: len(choice.message.content)]
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    text, finish, _ = stream_chat(servers["plain"].client(), schema_format(schema), max_tokens=4, extra_body=off)
    assert finish == ["length"] and text[: len(head)] == head[: len(text)]


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "pop": {"type": "integer"}},
        "required": ["city", "pop"]}
TOKYO = [{"role": "user", "content": "Tokyo is the largest city in the world, with a population of 37,400,068 "
                                     "people. Reply in JSON."}]


@pytest.mark.slow
def test_length_safe_budgets_complete_with_and_without_a_draft(servers):
    # The default: the output completes within max_tokens (SmolLM2 alone writes the population's
    # digits until the budget ends), the same tokens with a draft (batched and speculative paths).
    import openai

    def ask(served):
        client = served.client()
        reply = chat(client, schema_format(CITY), max_tokens=20, messages=TOKYO)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (served.name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), CITY)
        assert reply.usage.completion_tokens <= 20
        text, finish, _ = stream_chat(client, schema_format(CITY), max_tokens=20, messages=TOKYO)
        assert (text, finish) == (choice.message.content, ["stop"])
        return choice.message.content

    replies = on_each(servers, ask)
    assert replies["draft"] == replies["plain"]

    client = servers["plain"].client()
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, schema_format(CITY), max_tokens=3, messages=TOKYO)
    error = info.value.body
    assert (error["code"], error["param"], error["type"]) == ("max_tokens_too_small", "max_tokens",
                                                              "invalid_request_error")
    needed = int(re.search(r"at least (\d+)", error["message"]).group(1))
    assert 3 < needed <= 20
    reply = chat(client, schema_format(CITY), max_tokens=needed, messages=TOKYO)  # the named budget is enough
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens <= needed
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, None, max_tokens=3, messages=TOKYO, extra_body={"length_safe": "no"})
    assert info.value.body["param"] == "length_safe"
    # Off for one request: as before, the budget ends the digits.
    reply = chat(client, schema_format(CITY), max_tokens=12, messages=TOKYO, extra_body={"length_safe": False})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 12
    with pytest.raises(json.JSONDecodeError):
        json.loads(reply.choices[0].message.content)


NESTED_UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                           "maxItems": 2, "uniqueItems": True}}, "required": ["tags"]}


@pytest.mark.slow
@pytest.mark.parametrize("response_format, code, param, words", [
    (schema_format({"type": "objekt"}), "invalid_schema", "response_format.json_schema.schema", "objekt"),
    (schema_format(NESTED_UNIQUE), "unsupported_schema_keyword", "response_format.json_schema.schema",
     "'uniqueItems' at /properties/tags"),
    (schema_format(False), "empty_grammar", "response_format.json_schema.schema", "no JSON value"),
    ({"type": "json_schema", "schema": COLOR}, "invalid_response_format", "response_format", "'schema'"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "invalid_response_format",
     "response_format.json_schema.schema", "is required"),
    ({"type": "yaml"}, "invalid_response_format", "response_format.type", "'yaml'"),
    ({"type": "regex", "regex": "(ab"}, "invalid_regex", "response_format.regex", "invalid regex"),
    ({"type": "json_object", "whitespace": " *"}, "invalid_regex", "response_format.whitespace", "unbounded"),
])
def test_bad_response_formats_are_openai_400s(servers, response_format, code, param, words):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        chat(servers["plain"].client(), response_format, max_tokens=5)
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, param)
    assert words in error["message"]
    if code == "unsupported_schema_keyword":
        assert (error["keyword"], error["pointer"]) == ("uniqueItems", "/properties/tags")


def post(url: str, body: bytes | dict, path: str = "/v1/chat/completions", timeout: float = 60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, dict(r.headers), json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.load(e)


@pytest.mark.slow
def test_raw_error_shapes_and_refused_fields(servers):
    url = servers["plain"].url
    status, _, body = post(url, {"messages": ASK, "max_tokens": 5, "response_format": "json"})
    assert status == 400 and set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    for field, value in (("adapters", "lora"), ("draft_model", "other")):
        status, _, body = post(url, {"messages": ASK, "max_tokens": 5, field: value})
        assert status == 400 and body["error"]["param"] == field
        assert body["error"]["code"] == "unsupported_parameter"
    status, _, body = post(url, {"messages": ASK, "max_tokens": 2, "adapters": None, "draft_model": None})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2
    # A body nested past Python's recursion limit is a 400, not a dropped connection.
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, _, body = post(url, deep)
    assert status == 400 and "nested too deeply" in body["error"]["message"]


def test_a_schema_nested_past_the_recursion_limit_is_a_400_and_the_server_keeps_serving(servers):
    url = servers["plain"].url
    # a chain of 3,000 $refs into a cycle: its translation nests past Python's recursion limit
    defs: dict = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(3000)}
    defs["d3000"] = {"$ref": "#/$defs/d0"}
    wide = {"$defs": defs, "$ref": "#/$defs/d0"}
    for _ in range(2):  # the second answer comes from the grammar cache's remembered error
        status, _, body = post(url, {"messages": ASK, "max_tokens": 5, "response_format": schema_format(wide)})
        assert status == 400 and body["error"]["code"] == "grammar_too_large", body
        assert "nests too deeply" in body["error"]["message"] and "max_recursion_depth" in body["error"]["message"]
        assert body["error"]["param"] == "response_format.json_schema.schema"
    status, _, body = post(url, {"messages": ASK, "max_tokens": 5,
                                 "response_format": schema_format({"type": "integer"})})
    assert status == 200 and body["choices"][0]["message"]["content"].lstrip("-").isdigit()


@pytest.mark.slow
def test_non_strict_schema_reports_unenforced_keywords(servers):
    raw = servers["plain"].client().chat.completions.with_raw_response.create(
        model="smollm", messages=ASK, max_tokens=12, response_format=schema_format(NESTED_UNIQUE, strict=False))
    assert json.loads(raw.headers["x-grammar-unenforced"]) == [["uniqueItems", "/properties/tags"]]
    choice = raw.parse().choices[0]
    if choice.finish_reason == "stop":
        instance = json.loads(choice.message.content)
        assert set(instance) == {"tags"} and set(instance["tags"]) <= {"a", "b"}


@pytest.mark.slow
def test_concurrent_clients_with_different_schemas(servers):
    plain = servers["plain"]
    schemas = [{"type": "object", "properties": {f"k{i}": {"enum": [f"v{i}a", f"v{i}b"]}, "ok": {"type": "boolean"}},
                "required": [f"k{i}", "ok"], "additionalProperties": False} for i in range(4)]
    barrier = threading.Barrier(len(schemas) + 1)

    def run(i):
        client = plain.client()
        barrier.wait(30)
        if i % 2:
            text, finish, _ = stream_chat(client, schema_format(schemas[i], name=f"s{i}"))
            return text, finish[0]
        reply = chat(client, schema_format(schemas[i], name=f"s{i}"))
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    def bad():
        import openai

        barrier.wait(30)
        with pytest.raises(openai.BadRequestError):
            chat(plain.client(), schema_format({"type": "objekt"}))
        return "bad"

    with ThreadPoolExecutor(len(schemas) + 1) as pool:
        futures = [pool.submit(run, i) for i in range(len(schemas))] + [pool.submit(bad)]
        results = [f.result(170) for f in futures]
    for i, (text, finish) in enumerate(results[:-1]):
        assert finish == "stop", (i, text)
        instance = json.loads(text)
        jsonschema.validate(instance, schemas[i])  # its own schema: no state leaked from a neighbour
    assert results[-1] == "bad"
    # Still up and answering afterwards.
    with urllib.request.urlopen(plain.url + "/health", timeout=5) as r:
        assert json.load(r) == {"status": "ok"}
    reply = chat(plain.client(), schema_format(schemas[0], name="s0"))
    jsonschema.validate(json.loads(reply.choices[0].message.content), schemas[0])


@pytest.mark.slow
def test_models_endpoint_lists_the_served_model(servers):
    models = servers["plain"].client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.slow
def test_smollm_tool_calls_through_the_fallback_format(servers):
    # SmolLM2's template has no tools: a named call is the fallback JSON, answered as tool_calls.
    client = servers["plain"].client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="smollm", messages=WEATHER_ASK, tools=[WEATHER_TOOL],
                                           tool_choice=named, max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    chunks = list(client.chat.completions.create(model="smollm", messages=WEATHER_ASK, tools=[WEATHER_TOOL],
                                                 tool_choice=named, max_tokens=40, stream=True))
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    # auto: nothing tells a call from an answer in this format: text, and the response says so.
    raw = client.chat.completions.with_raw_response.create(model="smollm", messages=WEATHER_ASK, tools=[WEATHER_TOOL],
                                                           max_tokens=4)
    assert json.loads(raw.headers["x-grammar-unenforced"]) == [["tools", "/tools"]]
    assert raw.parse().choices[0].message.tool_calls is None


@pytest.mark.slow
def test_a_thinking_budget_needs_a_model_with_think_tags(servers):
    import openai

    for field, value in (("thinking_budget", 16), ("reasoning_effort", "low")):
        with pytest.raises(openai.BadRequestError) as info:
            chat(servers["plain"].client(), None, max_tokens=4, extra_body={field: value})
        assert (info.value.body["code"], info.value.body["param"]) == ("unsupported_parameter", field)


def test_a_model_that_does_not_load_exits_with_a_message(tmp_path):
    missing = tmp_path / "missing.gguf"
    run = subprocess.run([sys.executable, "-m", "grammar_mlx.server", "--port", "0", "--model", str(missing)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("error: ") and "missing.gguf" in run.stderr
    assert "listening" not in run.stdout


def test_an_mlx_lm_whose_seam_moved_is_refused_at_start_naming_the_versions():
    # mlx-lm's private function gone (as a release could do): the server refuses before loading a model.
    code = ("import sys; import mlx_lm.server as s; del s.ResponseGenerator._share_request; "
            "from grammar_mlx.server import main; sys.exit(main(['--port', '0']))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    first = run.stderr.splitlines()[0]
    assert first.startswith("error: grammar_mlx.server cannot run on the installed mlx-lm "), run.stderr
    assert "mlx_lm.server.ResponseGenerator._share_request is gone" in first
    assert "Supported: mlx-lm>=0.32,<0.33" in first
    assert "listening" not in run.stdout


def test_draft_layers_past_the_model_exit_2_naming_the_flag():
    run = subprocess.run([sys.executable, "-m", "grammar_mlx.server", "--port", "0", "--draft-layers", "100"],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("error: --draft-layers 100: the model has 30 layers"), run.stderr
    assert "listening" not in run.stdout


# --- faults: limits, refused bodies, shutdown, transient compile errors ------------------------------


def sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE stream, in order (comments such as keepalives left out)."""
    return [block[len("data: "):] for block in raw.decode().split("\n\n") if block.startswith("data: ")]


def raw_exchange(url: str, request: bytes) -> bytes:
    """Send `request` on a fresh connection; the whole reply (the server closes the connection)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


@pytest.mark.slow
def test_refused_bodies_do_not_disturb_a_client_being_served(servers):
    import openai

    plain = servers["plain"]
    client = plain.client()
    messages = [{"role": "user", "content": "Count from one to twenty in words."}]
    stream = client.chat.completions.create(model="smollm", messages=messages, max_tokens=24, stream=True)
    chunks = iter(stream)
    first = next(chunks)  # the stream is being served from here on
    # The embedded model's default limit is 1 MiB: a 10 MB body is refused with 413, and fast enough
    # that the client, which sends it whole before reading, gets the answer.
    huge = json.dumps({"messages": [{"role": "user", "content": "x " * 5_000_000}]}).encode()
    status, headers, body = post(plain.url, huge)
    assert status == 413 and body["error"]["code"] == "request_too_large" and "1048576" in body["error"]["message"]
    with pytest.raises(openai.APIStatusError) as info:  # the real client, too
        client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "x " * 5_000_000}])
    assert info.value.status_code == 413
    # Refused on its Content-Length alone: the answer comes before a byte of the body is sent.
    reply = raw_exchange(plain.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
    assert reply.startswith(b"HTTP/1.0 413") or reply.startswith(b"HTTP/1.1 413")
    status, _, body = post(plain.url, b'{"messages": [{"role": "user", "content": "caf\xe9"}]}')
    assert (status, body["error"]["code"]) == (400, "invalid_body") and "not UTF-8" in body["error"]["message"]
    status, _, body = post(plain.url, b'{"messages": [{"role": "user"')
    assert (status, body["error"]["code"]) == (400, "invalid_body") and "not valid JSON" in body["error"]["message"]
    reply = raw_exchange(plain.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                    b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert b" 411 " in reply.split(b"\r\n")[0] and b"length_required" in reply
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, None, max_tokens=2, n=3)
    assert (info.value.body["code"], info.value.body["param"]) == ("unsupported_parameter", "n")
    with pytest.raises(openai.BadRequestError) as info:  # about 9000 tokens; the context is 8192
        chat(client, None, max_tokens=2, messages=[{"role": "user", "content": "word " * 9000}])
    error = info.value.body
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "the model's context is 8192 tokens" in error["message"]
    rest = list(chunks)
    text = "".join(c.choices[0].delta.content or "" for c in [first, *rest] if c.choices)
    assert rest[-1].choices[0].finish_reason in ("stop", "length")
    # The same request alone answers the same: nothing of the refused ones leaked into it.
    alone = chat(client, None, max_tokens=24, messages=messages)
    assert alone.choices[0].message.content == text


@pytest.mark.slow
def test_sigterm_ends_requests_in_flight_with_an_error_then_done_and_exits(smollm_path):
    import http.client

    s = Server("sigterm", "--no-preload-json-object")
    try:
        s.wait_ready()
        host, port = s.url.removeprefix("http://").split(":")

        def start(content, max_tokens):
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                         body=json.dumps({"messages": [{"role": "user", "content": content}], "stream": True,
                                          "max_tokens": max_tokens}))
            response = conn.getresponse()
            assert response.status == 200
            return response

        streaming = start("Tell a long story about a lighthouse.", 300)
        head = b""
        while b'"content"' not in head:  # tokens are arriving
            head += streaming.read1(4096)
        # A long prompt (one prefill step of 2048 tokens takes the generation thread a while): its
        # stream's headers come once the generation thread has taken it.
        prefilling = start("Summarize: " + "the sea was calm and the light was on. " * 250, 5)
        s.proc.send_signal(signal.SIGTERM)
        for response, before in ((streaming, head), (prefilling, b"")):
            events = sse_events(before + response.read())
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert (error["code"], error["type"]) == ("server_shutting_down", "server_error")
        assert s.proc.wait(30) == 0  # a bound against hanging; the server allows itself a few seconds
    finally:
        s.stop()


@pytest.mark.slow
def test_a_server_on_the_cpu_builds_its_masking_primitive_before_it_says_ready(smollm_path, tmp_path):
    """On MLX's CPU backend the first constrained request must not wait for the cpu-native build:
    with an empty cache directory, the built primitive is there when the server first answers."""
    import mlx.core as mx

    from grammar_mlx.kernels import dispatch

    if mx.default_device() != mx.cpu or dispatch.cpu_native_error() is not None:
        pytest.skip(f"no cpu-native path here: {dispatch.cpu_native_error() or 'not the CPU backend'}")
    s = Server("fresh-cache", "--no-preload-json-object", env={"GRAMMAR_MLX_CACHE_DIR": str(tmp_path)})
    try:
        s.wait_ready()
        built = sorted(p.name for p in (tmp_path / "native").iterdir())
        assert len(built) == 1 and built[0].startswith("token_bitmask_cpu-"), built
    finally:
        s.stop()


@pytest.fixture(scope="module")
def in_process(smollm_path):
    """The server in this process (so that a test can inject faults), with small limits."""
    import argparse

    from grammar_mlx import models

    pytest.importorskip("openai", reason="the openai client is a test extra")
    parser = argparse.ArgumentParser()
    server.add_serve_arguments(parser)
    args = parser.parse_args(["--max-tokens", "16"])
    model, tokenizer = models.default_model()
    grammars = server.Grammars(server.served_vocabulary(tokenizer), logits_width_of(model))
    provider = server.LoadedModelProvider(server.mlx_cli_args(args), model, tokenizer, model_id="smollm")
    limits = server.ServerLimits(max_body_bytes=64 * 1024, context_length=48)
    generator = server.GrammarResponseGenerator(provider, None, grammars, limits)
    httpd = server.make_server("127.0.0.1", 0, generator)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    import openai

    yield SimpleNamespace(url=url, grammars=grammars, generator=generator,
                          client=openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120))
    httpd.shutdown()
    httpd.server_close()
    assert generator.shutdown(30)


@pytest.mark.slow
def test_a_transient_compile_failure_is_not_cached(in_process, monkeypatch):
    import openai

    from grammar_mlx.errors import CompileWorkerError

    real = server.cache.compile_json_schema
    failures = []

    def compile_once_failing(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise CompileWorkerError("the compile worker died (exit -9)", exit_code=-9)
        return real(*args, **kwargs)

    monkeypatch.setattr(server.cache, "compile_json_schema", compile_once_failing)
    schema = {"type": "object", "properties": {"transient": {"type": "boolean"}}, "required": ["transient"],
              "additionalProperties": False}
    short = [{"role": "user", "content": "Is it?"}]  # the in-process context is small
    with pytest.raises(openai.InternalServerError) as info:
        chat(in_process.client, schema_format(schema), max_tokens=14, messages=short)
    assert info.value.status_code == 503 and info.value.body["code"] == "compile_worker_failed"
    reply = chat(in_process.client, schema_format(schema), max_tokens=14, messages=short)  # compiled again
    assert json.loads(reply.choices[0].message.content).keys() == {"transient"}


@pytest.mark.slow
def test_a_request_waiting_to_start_is_refused_once_the_server_stops(smollm_path):
    # mlx-lm answers any exception from generate() as a 404; this one must reach the handler as a 503.
    import argparse

    from mlx_lm import server as mlx_server

    from grammar_mlx import models

    parser = argparse.ArgumentParser()
    server.add_serve_arguments(parser)
    model, tokenizer = models.default_model()
    provider = server.LoadedModelProvider(server.mlx_cli_args(parser.parse_args([])), model, tokenizer, model_id="m")
    generator = server.GrammarResponseGenerator(provider, None, grammars=None)
    try:
        generator.closing.set()
        request = mlx_server.CompletionRequest("text", "hi", [], None, None)
        args = mlx_server.GenerationArguments(
            model=server.SERVED_MODEL, sampling=mlx_server.SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.1),
            logits=mlx_server.LogitsProcessorArguments(None, 0.0, 20, 0.0, 20, 0.0, 20), stop_words=[], max_tokens=1,
            num_draft_tokens=3, logprobs=False, top_logprobs=-1, seed=None, chat_template_kwargs=None)
        with pytest.raises(server.GenerationRefused) as info:
            generator.generate(request, args)
        assert not isinstance(info.value, Exception)
        assert error_response(info.value.error)[0] == 503
        assert info.value.error.code == "server_shutting_down"
    finally:
        assert generator.shutdown(30)


@pytest.mark.slow
def test_in_process_limits_body_and_context(in_process):
    import openai

    client = in_process.client
    with pytest.raises(openai.APIStatusError) as info:
        chat(client, None, messages=[{"role": "user", "content": "y" * 70_000}])
    assert info.value.status_code == 413 and "65536 bytes" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, None, max_tokens=10, messages=[{"role": "user", "content": "word " * 8}])  # 39 + 10 > 48
    assert info.value.body["param"] == "max_tokens" and "context is 48 tokens" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, None, messages=[{"role": "user", "content": "word " * 20}])
    assert info.value.body["param"] == "messages" and "the prompt is 51 tokens" in info.value.body["message"]
    # Without an explicit budget, the default (16) shrinks to what the context leaves (the regex
    # keeps the model from stopping before it; length-safe decoding off, since the regex cannot
    # complete in what is left).
    digits = {"type": "regex", "regex": "[0-9]{40}"}
    reply = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "word " * 8}],
                                           extra_body={"response_format": digits, "length_safe": False})
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 48
    assert reply.usage.completion_tokens < 16 and reply.choices[0].finish_reason == "length"
    # Length-safe (the default), that budget is refused in the handler, naming the default budget.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "word " * 8}],
                                       extra_body={"response_format": digits})
    error = info.value.body
    assert (error["code"], error["param"]) == ("max_tokens_too_small", "max_tokens")
    assert "the server's default budget" in error["message"] and "at least 41" in error["message"]


ORDER = {"type": "object", "properties": {
    "customer_name": {"type": "string", "maxLength": 12},
    "delivery_method": {"enum": ["standard_shipping", "express_shipping", "store_pickup"]},
    "payment_status": {"enum": ["payment_pending", "payment_received"]},
    "gift_wrapping_requested": {"type": "boolean"},
    "shipping_address": {"type": "object", "properties": {"city_name": {"type": "string", "maxLength": 10},
                                                          "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"}},
                         "required": ["city_name", "postal_code"], "additionalProperties": False}},
    "required": ["customer_name", "delivery_method", "payment_status", "gift_wrapping_requested",
                 "shipping_address"], "additionalProperties": False}
ORDER_ASK = [{"role": "user", "content": "Make up one customer order as JSON."}]


def _details(reply) -> dict:
    return (reply.usage.model_dump().get("completion_tokens_details") or {})


@pytest.mark.slow
def test_fast_forward_through_the_server_with_and_without_a_draft(servers):
    """Constrained requests fast-forward the text their grammar forces by default (canonical): the
    answer is schema-valid and `usage` says how many tokens were forced and how many were sampled
    from a head computed at the grammar's allowed ids alone; "verified" answers token for
    token what plain decoding (`"fast_forward": false`) answers; a draft changes none of it."""
    def ask(served):
        client, answers = served.client(), {}
        for mode in ("canonical", "verified", False):
            extra = {} if mode == "canonical" else {"fast_forward": mode}
            reply = chat(client, schema_format(ORDER), max_tokens=90, messages=ORDER_ASK, extra_body=extra)
            content = reply.choices[0].message.content
            assert reply.choices[0].finish_reason == "stop", content
            jsonschema.validate(json.loads(content), ORDER)
            forced = _details(reply).get("forced_tokens")
            sparse = _details(reply).get("sparse_head_tokens")
            if mode is False:
                assert forced is None and sparse is None
            else:
                assert forced is not None and 0 < forced < reply.usage.completion_tokens, (mode, forced)
                # Sampled at a sparse row (an enum's, a boolean's) from a head computed there alone: the
                # batch path does where the grammar is the row's only processor; the draft path's chains
                # verify drafted tokens with the whole head.
                assert sparse is not None and 0 <= sparse <= reply.usage.completion_tokens - forced, (mode, sparse)
                assert sparse > 0 or served.name == "draft", (mode, sparse)
            answers[served.name, mode] = (content, reply.usage.completion_tokens, forced)
        return answers

    answers = {key: value for each in on_each(servers, ask).values() for key, value in each.items()}
    for mode in ("canonical", "verified", False):
        assert answers["plain", mode][:2] == answers["draft", mode][:2], mode
    assert answers["plain", "verified"][:2] == answers["plain", False][:2]
    status, _, body = post(servers["plain"].url, {"messages": ORDER_ASK, "response_format": schema_format(ORDER),
                                                   "fast_forward": "always"})
    assert status == 400 and body["error"]["param"] == "fast_forward"


@pytest.mark.slow
def test_concurrent_constrained_clients_batch_and_each_answers_what_it_answers_alone(in_process, caplog):
    """Four clients at once on constrained requests with the default settings (canonical fast-forward):
    they run in mlx-lm's batch together (the generation thread's DEBUG line says so), and each answers
    token for token what it answers alone on the single path."""
    import logging

    schemas = [{"type": "object", "properties": {f"k{i}": {"enum": [f"v{i}a", f"v{i}b"]}, "ok": {"type": "boolean"}},
                "required": [f"k{i}", "ok"], "additionalProperties": False} for i in range(4)]
    asks = [[{"role": "user", "content": text}] for text in ("Is it?", "Which?", "Say one.", "Yes or no?")]
    generator = in_process.generator

    def ask(i):
        client = in_process.client
        if i % 2:
            text, finish, usage = stream_chat(client, schema_format(schemas[i], name=f"b{i}"), max_tokens=14,
                                              messages=asks[i])
            details = usage[0].model_dump().get("completion_tokens_details") or {}
            return text, finish[0], usage[0].completion_tokens, details.get("forced_tokens")
        reply = chat(client, schema_format(schemas[i], name=f"b{i}"), max_tokens=14, messages=asks[i])
        return (reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.completion_tokens,
                _details(reply).get("forced_tokens"))

    generator.batch_fast_forward = False  # alone: grammar_mlx.decode's single-request loop
    try:
        alone = [ask(i) for i in range(4)]
    finally:
        generator.batch_fast_forward = True
    assert all(forced for *_, forced in alone), alone
    barrier = threading.Barrier(4)

    def together(i):
        barrier.wait(30)
        return ask(i)

    caplog.set_level(logging.DEBUG, logger="grammar_mlx.server.mlx_lm_seams")
    with ThreadPoolExecutor(4) as pool:
        batched = [f.result(170) for f in [pool.submit(together, i) for i in range(4)]]
    assert batched == alone
    rows = [int(m.group(1)) for r in caplog.records
            if (m := re.search(r"fast-forward in the batch: .* in steps of up to (\d+) rows", r.getMessage()))]
    assert len(rows) == 4 and max(rows) > 1, rows
