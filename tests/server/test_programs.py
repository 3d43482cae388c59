"""grammar_mlx.server.programs: what a context-free grammar does to a request's segments program."""

from __future__ import annotations

import pytest

from grammar_mlx.errors import InvalidRequestError
from grammar_mlx.segments import tools as tool_calls
from grammar_mlx.server import GrammarSpec, content_segment, segment_program

GRAMMAR = GrammarSpec("grammar", 'root ::= "yes" | "no"', origin="guided_grammar", syntax="gbnf")


def test_a_grammar_is_served_alone_from_the_first_token(qwen_tool_tokenizer):
    # "model": the model could open its thinking itself; under a grammar it does not.
    for state in ("closed", "model"):
        assert segment_program(qwen_tool_tokenizer, GRAMMAR, (), "auto", True, None, state) is None


def test_a_grammar_that_would_need_a_program_is_refused_not_served_unconstrained(qwen_tool_tokenizer):
    tools = tool_calls.parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    for args, why in ((((), "auto", True, None, "open"), "the prompt opens a thinking section"),
                      (((), "auto", True, 16, "model"), "a thinking budget is given"),
                      ((tools, "auto", True, None, "closed"), "tools are offered")):
        with pytest.raises(InvalidRequestError, match=why) as e:
            segment_program(qwen_tool_tokenizer, GRAMMAR, *args)
        assert (e.value.param, e.value.code) == ("guided_grammar", "unsupported_parameter")
    with pytest.raises(InvalidRequestError, match="not a segment"):
        content_segment(GRAMMAR)
