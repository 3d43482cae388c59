"""grammar_mlx.server live: a context-free grammar (GBNF, Lark, a recursive JSON Schema) after a
thinking model's reasoning (grammars/then.py through server/programs.py `reasoning_spec`), and beside
tools as the answer that is not a call (`answer_spec`), on tiny random-weight Qwen3 model directories
driven by the real `openai` client: the hybrid template (the model opens `<think>` itself: steered
there by a logit bias) and a template that opens it in the prompt (a random model never closes it:
the thinking budget does). The answer after `</think>` parses under the grammar, a call steered to
is a valid call, the reasoning comes apart, and a draft answers what no draft answers."""

from __future__ import annotations

import json
import re

import pytest
from test_server_grammars import SUM_GBNF, SUM_LARK, parses  # skips without the lark library

THINK = 151667
# A grammar whose text may start with a space: no gap is allowed before it, nothing is stripped.
SPACED_LARK = 'start: " "? "[" DIGIT ("," DIGIT)? "]"\nDIGIT: /[0-9]/\n'
TREE = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object",
    "properties": {"v": {"type": "integer"},
                   "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
    "required": ["v", "kids"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Write a sum."}]


@pytest.fixture
def servers(qwen_servers):
    """The session's tiny-Qwen3 servers (tests/conftest.py) by their part here."""
    return {"hybrid": qwen_servers["plain"], "draft": qwen_servers["draft"], "open": qwen_servers["thinking"]}


def reasoning_of(message) -> str:
    return getattr(message, "reasoning", None) or getattr(message, "reasoning_content", None) or ""


def ask(server, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 60)
    return server.client().chat.completions.create(model="m", **kw)


@pytest.mark.slow
def test_the_model_opens_its_thinking_then_the_gbnf_grammar(servers):
    bias = {str(THINK): 200}  # the hybrid template leaves opening <think> to the model: steer it there
    reply = ask(servers["hybrid"], logit_bias=bias, extra_body={"grammar": SUM_GBNF, "thinking_budget": 6})
    message, finish = reply.choices[0].message, reply.choices[0].finish_reason
    assert finish == "stop" and reasoning_of(message), message
    assert parses(SUM_LARK, message.content), message.content  # the gap after </think> is not content
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6
    # response_format's form, streamed: the same answer.
    chunks = list(servers["hybrid"].client().chat.completions.create(
        model="m", messages=ASK, max_tokens=60, stream=True, logit_bias=bias, extra_body={"thinking_budget": 6},
        response_format={"type": "grammar", "grammar": SUM_GBNF, "syntax": "gbnf"}))  # type: ignore[arg-type]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    thought = "".join(reasoning_of(c.choices[0].delta) for c in chunks if c.choices)
    assert content == message.content and thought == reasoning_of(message)
    # Not steered, the model may answer at once: still the grammar's answer.
    plain = ask(servers["hybrid"], extra_body={"grammar": SUM_GBNF})
    assert plain.choices[0].finish_reason == "stop" and parses(SUM_LARK, plain.choices[0].message.content)


@pytest.mark.slow
def test_a_prompt_opened_thinking_ends_at_the_budget_then_the_grammar(servers):
    for field in ({"grammar": SUM_GBNF}, {"guided_grammar": SUM_LARK}):
        reply = ask(servers["open"], extra_body={**field, "thinking_budget": 5})
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop" and reasoning_of(message), message
        assert parses(SUM_LARK, message.content), message.content
        assert reply.usage.completion_tokens_details.reasoning_tokens == 5
    # A grammar that may start with a space: no gap before it, and its leading space is kept.
    reply = ask(servers["open"], logit_bias={"220": 30},  # " "
                extra_body={"guided_grammar": SPACED_LARK, "thinking_budget": 3})
    content = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and parses(SPACED_LARK, content) and content.startswith(" ")


@pytest.mark.slow
def test_a_recursive_schema_after_the_thinking(servers):
    import jsonschema

    raw = servers["open"].client().chat.completions.with_raw_response.create(
        model="m", messages=ASK, max_tokens=80, extra_body={"thinking_budget": 4},
        response_format={"type": "json_schema", "json_schema": {"name": "tree", "schema": TREE}})
    assert raw.headers.get("X-Grammar-Unenforced") is None  # no depth bound: nothing relaxed
    reply = raw.parse()
    message = reply.choices[0].message
    assert reasoning_of(message) and reply.usage.completion_tokens_details.reasoning_tokens == 4
    assert reply.choices[0].finish_reason == "stop", message  # length-safe: the tree completes in the budget
    jsonschema.validate(json.loads(message.content), TREE)


@pytest.mark.slow
def test_a_regex_after_the_thinking_is_the_whole_content(servers):
    # Steered to a newline, which the model writes right after </think> where it may: the content is
    # still exactly a full match of the regex, streamed or not (no gap before a regex, none stripped).
    for regex in ("[a-z]{1,8}", "\n?[a-z]{1,8}"):
        kw = {"max_tokens": 30, "logit_bias": {"198": 30}, "extra_body": {"thinking_budget": 3},  # "\n"
              "response_format": {"type": "regex", "regex": regex}}
        reply = ask(servers["open"], **kw)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop" and reasoning_of(message), message
        assert re.fullmatch(regex, message.content), (regex, message.content)
        chunks = list(servers["open"].client().chat.completions.create(model="m", messages=ASK, stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == message.content


@pytest.mark.slow
def test_a_draft_answers_what_no_draft_answers(servers):
    think = {str(THINK): 200}
    for bias, extra in ((think, {"grammar": SUM_GBNF, "thinking_budget": 6}),
                        (think, {"grammar": SUM_GBNF, "thinking_budget": 2}),
                        ({}, {"guided_grammar": SUM_LARK})):
        plain = ask(servers["hybrid"], logit_bias=bias, extra_body=extra)
        drafted = ask(servers["draft"], logit_bias=bias, extra_body=extra)
        assert plain.choices[0].finish_reason == "stop"
        assert plain.choices[0].message.content == drafted.choices[0].message.content
        assert reasoning_of(plain.choices[0].message) == reasoning_of(drafted.choices[0].message)
        assert parses(SUM_LARK, plain.choices[0].message.content)


TOOL_CALL = 151657
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def calls_of(reply):
    return [(c.function.name, json.loads(c.function.arguments)) for c in reply.choices[0].message.tool_calls or []]


@pytest.mark.slow
def test_a_grammar_beside_tools_is_the_answer_or_a_call(servers):
    # Steered away from the call tag: the answer in the grammar, with or without the thinking first.
    away = {str(TOOL_CALL): -100}
    for bias, extra in ((away, {"grammar": SUM_GBNF, **NO_THINK}),
                        ({**away, str(THINK): 200}, {"grammar": SUM_GBNF, "thinking_budget": 6}),
                        (away, {"guided_grammar": SUM_LARK, **NO_THINK})):
        reply = ask(servers["hybrid"], tools=TOOLS, logit_bias=bias, extra_body=extra)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop" and not message.tool_calls, message
        assert parses(SUM_LARK, message.content), message.content  # the gap after </think> is not content
        assert bool(reasoning_of(message)) == ("thinking_budget" in extra)
    # Steered to the call tag: a call of an offered function with valid arguments, the thinking first
    # where asked (the call tag is not allowed inside it).
    to_call = {str(TOOL_CALL): 100}
    for bias, extra in ((to_call, {"grammar": SUM_GBNF, **NO_THINK}),
                        ({**to_call, str(THINK): 200}, {"grammar": SUM_GBNF, "thinking_budget": 4})):
        for parallel in (True, False):
            reply = ask(servers["hybrid"], tools=TOOLS, logit_bias=bias, extra_body=extra, max_tokens=80,
                        parallel_tool_calls=parallel)
            calls = calls_of(reply)
            assert reply.choices[0].finish_reason == "tool_calls" and calls, reply.choices[0].message
            assert all(name == "f" and set(args) == {"n"} and isinstance(args["n"], int) for name, args in calls)
            assert parallel or len(calls) == 1
            assert not (reply.choices[0].message.content or "").strip()
            assert (reply.usage.completion_tokens_details.reasoning_tokens == 4) == ("thinking_budget" in extra)


@pytest.mark.slow
def test_a_recursive_schema_beside_tools_has_no_depth_bound(servers):
    import jsonschema

    for strict in (False, True):  # strict too: nothing is relaxed, so nothing is refused
        fmt = {"type": "json_schema", "json_schema": {"name": "tree", "schema": TREE, "strict": strict}}
        for bias in ({str(TOOL_CALL): -100}, {str(TOOL_CALL): 100}):
            raw = servers["hybrid"].client().chat.completions.with_raw_response.create(
                model="m", messages=ASK, max_tokens=80, tools=TOOLS, response_format=fmt,  # type: ignore[arg-type]
                logit_bias=bias, extra_body=NO_THINK)
            assert raw.headers.get("X-Grammar-Unenforced") is None
            reply = raw.parse()
            finish, message = reply.choices[0].finish_reason, reply.choices[0].message
            if bias[str(TOOL_CALL)] > 0:
                assert finish == "tool_calls" and calls_of(reply), message
            else:  # length-safe: the tree completes within the budget
                assert finish == "stop" and not message.tool_calls, message
                jsonschema.validate(json.loads(message.content), TREE)


@pytest.mark.slow
def test_a_draft_answers_what_no_draft_answers_beside_tools(servers):
    for bias, extra in (({str(TOOL_CALL): -100}, {"grammar": SUM_GBNF, **NO_THINK}),
                        ({str(TOOL_CALL): 100, str(THINK): 200}, {"grammar": SUM_GBNF, "thinking_budget": 3})):
        plain = ask(servers["hybrid"], tools=TOOLS, logit_bias=bias, extra_body=extra, max_tokens=80)
        drafted = ask(servers["draft"], tools=TOOLS, logit_bias=bias, extra_body=extra, max_tokens=80)
        assert plain.choices[0].finish_reason in ("stop", "tool_calls")
        assert plain.choices[0].message.content == drafted.choices[0].message.content
        assert calls_of(plain) == calls_of(drafted) and reasoning_of(plain.choices[0].message) == reasoning_of(
            drafted.choices[0].message)
