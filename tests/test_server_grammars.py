"""grammar_mlx.server live with context-free grammars: a served tiny qwen3 model directory in a
subprocess, driven by the real `openai` client, through `response_format` {"type": "grammar"},
llama.cpp's `grammar` field and vLLM's `guided_grammar`. The request parsing is unit-tested in
tests/server/test_request.py."""

from __future__ import annotations

import pytest

lark = pytest.importorskip("lark", reason="the lark library is the oracle of the Lark grammars (test extra)")

# Finite languages (the budgets below also hold recursive ones: a CFG is length-safe, docs/grammars.md).
LIST_LARK = 'start: "[" NAME ("," NAME)? ("," NAME)? "]"\nNAME: /[a-z]{1,3}/\n'
SUM_GBNF = 'root ::= "(" term ("+" term)? ")"\nterm ::= [0-9] | "(" [0-9] "*" [0-9] ")"\n'
SUM_LARK = 'start: "(" term ("+" term)? ")"\nterm: DIGIT | "(" DIGIT "*" DIGIT ")"\nDIGIT: /[0-9]/\n'
ASK = [{"role": "user", "content": "Write something."}]


@pytest.fixture
def grammar_server(qwen_servers):
    return qwen_servers["plain"]  # the session's (tests/conftest.py)


def parses(grammar_text: str, text: str) -> bool:
    try:
        lark.Lark(grammar_text, parser="earley", lexer="dynamic").parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


def test_response_format_grammar_output_parses_by_the_grammar(grammar_server):
    client = grammar_server.client()
    reply = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=40,
        response_format={"type": "grammar", "grammar": LIST_LARK})  # type: ignore[arg-type]
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and parses(LIST_LARK, text), text
    stream = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=40, stream=True,
        response_format={"type": "grammar", "grammar": SUM_GBNF, "syntax": "gbnf"})  # type: ignore[arg-type]
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert parses(SUM_LARK, streamed), streamed


def test_llama_cpp_grammar_field_on_both_endpoints(grammar_server):
    client = grammar_server.client()
    chat = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, extra_body={"grammar": SUM_GBNF})
    assert chat.choices[0].finish_reason == "stop" and parses(SUM_LARK, chat.choices[0].message.content)
    done = client.completions.create(model="m", prompt="Sum:", max_tokens=40, extra_body={"grammar": SUM_GBNF})
    assert done.choices[0].finish_reason == "stop" and parses(SUM_LARK, done.choices[0].text), done.choices[0].text


def test_vllm_guided_grammar_reads_lark_and_gbnf(grammar_server):
    client = grammar_server.client()
    for text, oracle in ((LIST_LARK, LIST_LARK), (SUM_GBNF, SUM_LARK)):
        done = client.completions.create(model="m", prompt="Out:", max_tokens=40, extra_body={"guided_grammar": text})
        assert done.choices[0].finish_reason == "stop" and parses(oracle, done.choices[0].text), done.choices[0].text


# Unbounded nesting and repetition: a random-weight model left alone writes on past any budget.
NESTED_GBNF = 'root ::= expr\nexpr ::= term (("+" | "*") term)*\nterm ::= [0-9]+ | "(" expr ")" | "[" expr "]"\n'
NESTED_LARK = ('start: expr\nexpr: term (("+" | "*") term)*\nterm: DIGITS | "(" expr ")" | "[" expr "]"\n'
               'DIGITS: /[0-9]+/\n')


@pytest.mark.parametrize("max_tokens", [2, 5, 9])
def test_a_recursive_grammar_completes_within_a_tight_max_tokens(grammar_server, max_tokens):
    client = grammar_server.client()
    done = client.completions.create(model="m", prompt="Out:", max_tokens=max_tokens,
                                     extra_body={"grammar": NESTED_GBNF})
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and parses(NESTED_LARK, choice.text), choice.text
    assert done.usage.completion_tokens <= max_tokens
    # The chat answer (the model may think first: the thinking is made to end in time for the answer).
    chat = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=max_tokens + 4,
        response_format={"type": "grammar", "grammar": NESTED_GBNF, "syntax": "gbnf"})  # type: ignore[arg-type]
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "stop" and parses(NESTED_LARK, message.content), message


def test_a_max_tokens_below_the_grammars_bound_is_a_400_and_length_safe_off_cuts(grammar_server):
    import openai

    client = grammar_server.client()
    with pytest.raises(openai.BadRequestError) as info:  # 200 letters, then EOS
        client.completions.create(model="m", prompt="Out:", max_tokens=4,
                                  extra_body={"grammar": "root ::= [a-z]{200,}"})
    error = info.value.body
    assert (error["code"], error["param"]) == ("max_tokens_too_small", "max_tokens")
    assert "at least 201" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=1,
                                       response_format={"type": "grammar", "grammar": SUM_GBNF, "syntax": "gbnf"})  # type: ignore[arg-type]
    assert info.value.body["code"] == "max_tokens_too_small"
    # length_safe off: the grammar alone, cut by the budget.
    done = client.completions.create(model="m", prompt="Out:", max_tokens=4,
                                     extra_body={"grammar": "root ::= [a-z]{200,}", "length_safe": False})
    assert done.choices[0].finish_reason == "length"
    assert done.choices[0].text.isalpha() and done.choices[0].text.islower()


def test_a_bad_grammar_is_a_400_naming_line_and_column(grammar_server):
    import openai

    client = grammar_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="x", max_tokens=5,
                                  extra_body={"grammar": 'root ::= "a" item\nitem ::= "b" missing\n'})
    error = info.value.body
    assert (error["code"], error["param"], error["line"], error["column"]) == ("invalid_grammar", "grammar", 2, 14)
    assert "line 2, column 14" in error["message"] and "missing" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=5,
                                       response_format={"type": "grammar", "grammar": "start: (\"a\""})  # type: ignore[arg-type]
    error = info.value.body
    assert (error["code"], error["param"]) == ("invalid_grammar", "response_format.grammar")
    assert error["line"] == 1 and f"column {error['column']}" in error["message"]


def test_two_constraints_in_one_request_are_a_400(grammar_server):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        grammar_server.client().chat.completions.create(
            model="m", messages=ASK, max_tokens=5, response_format={"type": "json_object"},
            extra_body={"guided_grammar": LIST_LARK})
    error = info.value.body
    assert (error["code"], error["param"]) == ("conflicting_constraints", "guided_grammar")


TREE = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object",
    "properties": {"v": {"type": "integer"},
                   "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
    "required": ["v", "kids"], "additionalProperties": False}}}


def test_a_recursive_schema_is_served_through_the_grammar_engine(grammar_server, qwen_hf_tokenizer):
    # A $ref cycle has no depth bound (grammars/json_schema.py): nothing is reported unenforced, and the
    # answer is the schema's, complete within max_tokens (length-safe): the library's grammar (the
    # served model has the Qwen3 tokenizer) walks its bytes.
    import json

    import jsonschema

    from grammar_mlx import compile_json_schema
    from grammar_mlx.grammars import CFGGrammar

    grammar = compile_json_schema(TREE, qwen_hf_tokenizer)
    assert isinstance(grammar, CFGGrammar)
    client = grammar_server.client()
    for _ in range(2):  # the second request takes the grammar from the server's cache
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=ASK, max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "tree", "schema": TREE}})
        assert raw.headers.get("X-Grammar-Unenforced") is None
        reply = raw.parse()
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        state = grammar.initial_state
        for token in qwen_hf_tokenizer.encode(text, add_special_tokens=False):
            state = grammar.next_state(state, token)
            assert state >= 0, text
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), TREE)


# Every field a grammar may come in, each with a mistake: (endpoint, request fields, param, code, line, column).
BAD_GRAMMARS = [
    ("chat", {"extra_body": {"grammar": 'root ::= "a"\nx ::= ("b"\n'}}, "grammar", "invalid_grammar", 2, 7),
    ("completions", {"extra_body": {"guided_grammar": 'start: "a" b\n'}}, "guided_grammar", "invalid_grammar",
     1, 12),
    ("chat", {"extra_body": {"guided_grammar": 'root ::= b\nb ::= b "x"\n'}}, "guided_grammar",
     "empty_start_rule", 2, 1),
    ("completions", {"extra_body": {"response_format": {"type": "grammar", "syntax": "gbnf",
                                                        "grammar": 'root ::= "a"{3,2}'}}},
     "response_format.grammar", "invalid_grammar", 1, 13),
    ("chat", {"extra_body": {"structured_outputs": {"grammar": "root ::= [a-"}}}, "structured_outputs.grammar",
     "invalid_grammar", 1, 10),
]


@pytest.mark.parametrize(("endpoint", "fields", "param", "code", "line", "column"), BAD_GRAMMARS,
                         ids=[f"{b[0]}-{b[2]}-{b[3]}" for b in BAD_GRAMMARS])
def test_each_grammar_field_names_a_mistakes_place_and_the_server_stays_healthy(grammar_server, endpoint, fields,
                                                                             param, code, line, column):
    import openai

    client = grammar_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model="m", messages=ASK, max_tokens=20, **fields)
        else:
            client.completions.create(model="m", prompt="x", max_tokens=20, **fields)
    error = info.value.body
    assert (error["code"], error["param"], error["line"], error["column"]) == (code, param, line, column), error
    assert f"(line {line}, column {column})" in error["message"]
    done = client.completions.create(model="m", prompt="Out:", max_tokens=20, extra_body={"grammar": SUM_GBNF})
    assert done.choices[0].finish_reason == "stop" and parses(SUM_LARK, done.choices[0].text), done.choices[0].text


def test_a_grammar_nested_past_the_parsers_stack_is_too_large_and_the_server_stays_healthy(grammar_server):
    import openai

    client = grammar_server.client()
    deep = "root ::= " + "(" * 5000 + '"a"' + ")" * 5000
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt="x", max_tokens=20, extra_body={"grammar": deep})
    error = info.value.body
    assert (error["code"], error["param"]) == ("grammar_too_large", "grammar"), error
    assert "nests too deeply to parse" in error["message"]
    done = client.completions.create(model="m", prompt="Out:", max_tokens=20, extra_body={"grammar": SUM_GBNF})
    assert done.choices[0].finish_reason == "stop" and parses(SUM_LARK, done.choices[0].text), done.choices[0].text


@pytest.fixture
def draft_server(qwen_servers):
    return qwen_servers["draft"]  # the session's: a one-layer draft, 3 draft tokens


JSON_LARK = """?start: value
?value: object | array | string | SIGNED_NUMBER | "true" | "false" | "null"
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""
FLAT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def _ask(client, endpoint: str, stream: bool, **fields) -> tuple[str, str | None]:
    """The answer's text and finish reason, streamed or not, from either endpoint."""
    if endpoint == "chat":
        reply = client.chat.completions.create(model="m", messages=ASK, stream=stream, **fields)
    else:
        reply = client.completions.create(model="m", prompt="Out:", stream=stream, **fields)
    if not stream:
        choice = reply.choices[0]
        return (choice.message.content if endpoint == "chat" else choice.text), choice.finish_reason
    text, finish = "", None
    for chunk in reply:
        if chunk.choices:
            part = chunk.choices[0].delta.content if endpoint == "chat" else chunk.choices[0].text
            text, finish = text + (part or ""), chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_sequence_of_grammar_schema_and_free_requests_on_a_draft_server(draft_server, stream):
    # One speculative server, every way a grammar comes in, between plain schemas and unconstrained
    # requests, with a tight and a loose budget: each answer is complete and in its language.
    import json

    import jsonschema

    client = draft_server.client()
    tree = {"type": "json_schema", "json_schema": {"name": "tree", "schema": TREE}}
    flat = {"type": "json_schema", "json_schema": {"name": "flat", "schema": FLAT}}
    for max_tokens in (12, 60):
        asks = [
            ("chat", {"response_format": {"type": "grammar", "grammar": JSON_LARK}}, lambda t: parses(JSON_LARK, t)),
            ("completions", {}, None),
            ("chat", {"response_format": {"type": "grammar", "grammar": NESTED_GBNF, "syntax": "gbnf"}},
             lambda t: parses(NESTED_LARK, t)),
            ("chat", {"response_format": flat}, lambda t: jsonschema.validate(json.loads(t), FLAT) is None),
            ("completions", {"extra_body": {"grammar": NESTED_GBNF}}, lambda t: parses(NESTED_LARK, t)),
            ("chat", {"extra_body": {"grammar": SUM_GBNF}}, lambda t: parses(SUM_LARK, t)),
            ("completions", {"extra_body": {"guided_grammar": JSON_LARK}}, lambda t: parses(JSON_LARK, t)),
            ("chat", {"extra_body": {"guided_grammar": NESTED_GBNF}}, lambda t: parses(NESTED_LARK, t)),
            ("chat", {"response_format": tree}, lambda t: jsonschema.validate(json.loads(t), TREE) is None),
            ("chat", {}, None),
        ]
        for endpoint, fields, in_language in asks:
            if fields.get("response_format") is tree and max_tokens < 18:  # the tree's shortest answer: a 400
                import openai

                with pytest.raises(openai.BadRequestError, match="at least 18"):
                    _ask(client, endpoint, stream, max_tokens=max_tokens, **fields)
                continue
            text, finish = _ask(client, endpoint, stream, max_tokens=max_tokens, **fields)
            if in_language is None:
                assert finish in ("stop", "length")
                continue
            assert finish == "stop" and in_language(text), (endpoint, fields, text)


def test_a_grammar_whose_only_text_is_empty_answers_nothing(grammar_server):
    client = grammar_server.client()
    for field in ({"grammar": 'root ::= ""'}, {"guided_grammar": 'start: ""'}):
        done = client.completions.create(model="m", prompt="Out:", max_tokens=5, extra_body=field)
        # (The hybrid model may write the gap a thinking section leaves before the answer: stripped.)
        assert (done.choices[0].text, done.choices[0].finish_reason) == ("", "stop")


def test_a_regex_after_a_thinking_section_completes_within_max_tokens_as_a_grammar_does(grammar_server):
    # The completions prompt leaves the (hybrid) model free to open <think>; greedy, it does. Both end
    # in time; at the budget's end the regex's empty match is complete ("stop"), not cut free text.
    client = grammar_server.client()
    for field in ({"grammar": 'root ::= "a"?'}, {"guided_regex": "a?"}):
        done = client.completions.create(model="m", prompt="Out:", max_tokens=5, extra_body=field)
        assert done.choices[0].finish_reason == "stop", (field, done.usage)
        assert done.choices[0].text in ("", "a")
