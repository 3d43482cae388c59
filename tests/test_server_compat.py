"""grammar_mlx.server live with the constraint fields of vLLM's and llama.cpp's clients: plain HTTP
bodies as those clients send them (and the `openai` client's `extra_body`) to the embedded SmolLM2,
with and without a truncated draft. The parsing is unit-tested in tests/server/test_request_compat.py."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import test_server
from conftest import Server

servers = test_server.servers  # the session's plain and draft SmolLM2 servers

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999}},
        "required": ["city", "population"], "additionalProperties": False}
CHOICES = ["Paris", "New York", "a.b (c)*"]  # the last is literal text, not a regex
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
ASK = [{"role": "user", "content": "Name a city and its population as JSON."}]


def post(served: Server, path: str, body: dict) -> tuple[int, dict]:
    status, _, answer = test_server.post(served.url, body, path, timeout=300)
    return status, answer


def chat_text(served: Server, extra: dict, max_tokens: int = 40) -> str:
    status, answer = post(served, "/v1/chat/completions",
                          {"model": "m", "messages": ASK, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    return answer["choices"][0]["message"]["content"]


# Each body as its client sends it, and what its output must be.
BODIES = [
    ("vllm guided_json text", {"guided_json": json.dumps(CITY), "guided_whitespace_pattern": "[ ]?"}, "json"),
    ("vllm structured_outputs.json", {"structured_outputs": {"json": CITY}}, "json"),
    ("llama.cpp json_schema", {"json_schema": CITY}, "json"),
    ("vllm guided_regex", {"guided_regex": DATE, "guided_decoding_backend": "xgrammar"}, "date"),
    ("vllm guided_choice", {"guided_choice": CHOICES}, "choice"),
    ("vllm structured_outputs.choice", {"structured_outputs": {"choice": CHOICES}}, "choice"),
]


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), CITY)
    elif kind == "date":
        assert re.fullmatch(DATE, text), text
    else:
        assert text in CHOICES, text


@pytest.mark.slow
def test_vllm_and_llama_cpp_bodies_constrain_exactly_with_and_without_a_draft(servers):
    # Each server answers every body in turn; the two servers at once.
    answers = test_server.on_each(servers, lambda served: [chat_text(served, extra) for _, extra, _ in BODIES])
    for (name, _, kind), plain, draft in zip(BODIES, answers["plain"], answers["draft"]):
        check(kind, plain)
        assert draft == plain, (name, plain, draft)


@pytest.mark.slow
def test_completions_endpoint_and_the_openai_clients_extra_body(servers):
    pytest.importorskip("openai", reason="the openai client is a test extra")
    status, answer = post(servers["plain"], "/v1/completions",
                          {"model": "m", "prompt": "The date today is ", "max_tokens": 20, "guided_regex": DATE})
    assert status == 200 and re.fullmatch(DATE, answer["choices"][0]["text"]), answer
    status, answer = post(servers["plain"], "/v1/completions",
                          {"model": "m", "prompt": "City JSON:", "max_tokens": 40, "json_schema": CITY})
    assert status == 200, answer
    jsonschema.validate(json.loads(answer["choices"][0]["text"]), CITY)
    client = servers["plain"].client()
    reply = client.chat.completions.create(model="m", messages=ASK, max_tokens=10,
                                           extra_body={"guided_choice": CHOICES})
    assert reply.choices[0].message.content in CHOICES
    done = client.completions.create(model="m", prompt="Pick:", max_tokens=10,
                                     extra_body={"structured_outputs": {"choice": CHOICES}})
    assert done.choices[0].text in CHOICES


@pytest.mark.slow
@pytest.mark.parametrize("extra, param, code", [
    ({"guided_json": CITY, "response_format": {"type": "json_object"}}, "guided_json", "conflicting_constraints"),
    ({"json_schema": CITY, "guided_regex": DATE}, "guided_regex", "conflicting_constraints"),
    ({"structured_outputs": {"json": CITY, "choice": CHOICES}}, "structured_outputs.choice",
     "conflicting_constraints"),
    ({"guided_choice": []}, "guided_choice", "invalid_constraint"),
    ({"guided_choice": ["a", 2]}, "guided_choice[1]", "invalid_constraint"),
    ({"guided_json": "{oops"}, "guided_json", "invalid_schema"),
    ({"guided_json": {"type": "strnig"}}, "guided_json", "invalid_schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid_regex"),
    ({"guided_json": CITY, "guided_whitespace_pattern": "["}, "guided_whitespace_pattern", "invalid_regex"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "unsupported_parameter"),
])
def test_conflicts_and_bad_values_are_400s_with_a_stable_code(servers, extra, param, code):
    status, answer = post(servers["plain"], "/v1/chat/completions",
                          {"model": "m", "messages": ASK, "max_tokens": 5, **extra})
    assert (status, answer["error"]["code"], answer["error"]["param"]) == (400, code, param), answer
