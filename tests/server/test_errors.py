"""grammar_mlx.server.errors: the one error table, the OpenAI error shape, docs/server.md's table."""

from __future__ import annotations

import re
from pathlib import Path

from grammar_mlx import server
from grammar_mlx.errors import (
    EmptyLanguageError,
    GrammarError,
    InvalidRegexError,
    InvalidRequestError,
    TokenBudgetError,
    UnsupportedSchemaError,
)
from grammar_mlx.server import (
    GrammarSpec,
    error_response,
)


def test_error_response_shapes():
    spec = GrammarSpec("json_schema", '{"type":"array","uniqueItems":true}', True)
    status, body = error_response(UnsupportedSchemaError("'uniqueItems' at /x", keyword="uniqueItems", pointer="/x"),
                                  spec)
    assert status == 400
    assert body == {"error": {"message": "'uniqueItems' at /x", "type": "invalid_request_error",
                              "param": "response_format.json_schema.schema", "code": "unsupported_schema_keyword",
                              "keyword": "uniqueItems", "pointer": "/x"}}
    status, body = error_response(InvalidRegexError("bad", position=3),
                                  GrammarSpec("regex", "(a", origin="response_format"))
    assert (status, body["error"]["code"], body["error"]["param"], body["error"]["position"]) == (
        400, "invalid_regex", "response_format.regex", 3)
    status, body = error_response(InvalidRegexError("ws"), GrammarSpec("json_schema", "{}", False, "\\s*"))
    assert body["error"]["param"] == "response_format.json_schema.whitespace"
    status, body = error_response(EmptyLanguageError("none"),
                                  GrammarSpec("json_schema", '{"type":"object"}', origin="response_format"))
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "empty_grammar", "response_format")
    status, body = error_response(InvalidRequestError("no", param="adapters"))
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "adapters", "invalid_response_format")
    status, body = error_response(KeyError("boom"))
    assert status == 500 and body["error"]["type"] == "server_error" and "boom" in body["error"]["message"]


def all_grammar_error_classes():
    import grammar_mlx.errors as errors

    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, GrammarError)]


def test_every_grammar_error_has_its_own_status_and_code():
    rows = {}
    for cls in all_grammar_error_classes() + [server.ServerUnavailableError]:
        error = cls.__new__(cls)
        Exception.__init__(error, "x")
        for name, value in (("param", None), ("status", 400), ("code", None), ("keyword", None),
                            ("pointer", None), ("position", None), ("line", 1), ("column", 1)):
            if not hasattr(error, name):
                setattr(error, name, value)
        status, body = error_response(error)
        rows[cls.__name__] = (status, body["error"]["code"], body["error"]["type"])
    codes = [code for _, code, _ in rows.values()]
    assert len(set(codes)) == len(codes), rows  # stable and distinct: a client can tell them apart
    assert rows["GrammarError"][1] == "grammar_error"  # the net is used only by the base class itself
    assert rows["CompileTimeoutError"] == (400, "compile_timeout", "invalid_request_error")
    assert rows["GrammarTooLargeError"] == (400, "grammar_too_large", "invalid_request_error")
    assert rows["CompileWorkerError"] == (503, "compile_worker_failed", "server_error")
    assert rows["InvalidArgumentError"] == (400, "invalid_argument", "invalid_request_error")
    assert all((status >= 500) == (kind == "server_error") for status, _, kind in rows.values())
    too_large = InvalidRequestError("big", status=413, code="request_too_large")
    assert error_response(too_large)[0] == 413 and error_response(too_large)[1]["error"]["code"] == "request_too_large"
    shutting = server.ServerUnavailableError("stopping", code="server_shutting_down")
    assert server.error_status_and_code(shutting) == (503, "server_shutting_down")


def test_a_token_budget_error_is_a_400_on_max_tokens():
    status, body = error_response(TokenBudgetError("needs 9", needed=9, max_tokens=4),
                                  GrammarSpec("json_schema", "{}"))
    assert (status, body["error"]["code"], body["error"]["param"]) == (400, "max_tokens_too_small", "max_tokens")


# --- the one table ---------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent.parent


def test_docs_error_table_is_the_generated_one():
    docs = (REPO / "docs" / "server.md").read_text()
    start = docs.index("<!-- generated from grammar_mlx/server/errors.py")
    start = docs.index("\n", start) + 1
    end = docs.index("<!-- end of the generated table -->")
    assert docs[start:end] == server.errors_markdown(), "regenerate it: python -m grammar_mlx.server.errors"


def test_every_code_the_package_raises_is_a_row_with_its_status():
    rows = {(row.code, row.status) for row in server.ERROR_CODES}
    codes = {row.code for row in server.ERROR_CODES}
    raised = set()
    for path in (REPO / "grammar_mlx").rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r'code="(\w+)"', text):
            raised.add(match.group(1))
        # an explicit status beside the code: that row
        for match in re.finditer(r'status=(\d+), code="(\w+)"', text):
            assert (match.group(2), int(match.group(1))) in rows, (path, match.group(0))
    assert raised - codes == set()
    assert {"invalid_body", "request_too_large", "rank_grammar_failed", "not_found"} <= codes
    for row in server.ERROR_CODES:
        assert (row.status >= 500) == (server.error_body("m", row.status, row.code)["error"]["type"] == "server_error")


def test_a_bad_grammar_is_a_400_naming_its_field_line_and_column():
    from grammar_mlx.errors import EmptyGrammarError, InvalidGrammarError

    error = InvalidGrammarError("undefined rule 'foo'", line=2, column=7)
    for origin, param in (("response_format", "response_format.grammar"), ("grammar", "grammar"),
                          ("guided_grammar", "guided_grammar")):
        status, body = error_response(error, GrammarSpec("grammar", "x", origin=origin, syntax="gbnf"))
        assert (status, body["error"]["code"], body["error"]["param"]) == (400, "invalid_grammar", param)
        assert (body["error"]["line"], body["error"]["column"]) == (2, 7)
        assert "line 2, column 7" in body["error"]["message"]
    status, body = error_response(EmptyGrammarError("root derives no string", line=1, column=1),
                                  GrammarSpec("grammar", "x", origin="grammar", syntax="gbnf"))
    assert (status, body["error"]["code"], body["error"]["line"]) == (400, "empty_start_rule", 1)
    status, body = error_response(InvalidRequestError("two", param="grammar", code="conflicting_constraints"))
    assert (status, body["error"]["code"]) == (400, "conflicting_constraints")
