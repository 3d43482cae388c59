"""grammar_mlx.server.handler: its checks of a request, read in process (no server)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from grammar_mlx import server
from grammar_mlx.errors import (
    InvalidRequestError,
)
from grammar_mlx.server import (
    error_response,
)


def fit(body, max_tokens, prompt_tokens, context=100):
    from types import SimpleNamespace

    handler = SimpleNamespace(body=body, max_tokens=max_tokens, response_generator=SimpleNamespace(
        limits=server.ServerLimits(context_length=context)))
    server.GrammarAPIHandler._fit_context(handler, prompt_tokens, "messages")
    return handler.max_tokens


def test_prompt_length_against_the_context():
    assert fit({}, 512, 90) == 10  # the server's default budget shrinks to what the context leaves
    assert fit({}, 5, 90) == 5
    assert fit({"max_tokens": 10}, 10, 90) == 10
    for body, prompt, param, words in (({}, 100, "messages", "the prompt is 100 tokens; the model's context is 100"),
                                       ({"max_tokens": 11}, 90, "max_tokens", "plus max_tokens (11) is 101 tokens")):
        with pytest.raises(InvalidRequestError) as info:
            fit(body, body.get("max_tokens", 512), prompt)
        assert (info.value.code, info.value.param) == ("context_length_exceeded", param)
        assert words in str(info.value)
    assert fit({"max_tokens": 10**6}, 10**6, 10**5, context=None) == 10**6  # unknown context: no check


def test_length_safe_request_field_and_server_default():
    def handler(body, default=True):
        return SimpleNamespace(body=body, response_generator=SimpleNamespace(length_safe=default))

    read = server.GrammarAPIHandler._length_safe
    assert read(handler({})) is True and read(handler({}, default=False)) is False
    assert read(handler({"length_safe": False})) is False and read(handler({"length_safe": True}, False)) is True
    for bad in ("false", 0, [], {}):
        with pytest.raises(InvalidRequestError) as info:
            read(handler({"length_safe": bad}))
        assert info.value.param == "length_safe" and error_response(info.value)[1]["error"]["code"] == (
            "invalid_argument")
    import argparse

    parser = argparse.ArgumentParser()
    server.add_serve_arguments(parser)
    assert parser.parse_args([]).length_safe is True and parser.parse_args(["--no-length-safe"]).length_safe is False


def test_admission_holds_at_most_max_queued_places():
    generator = SimpleNamespace(_idle=threading.Condition(), _admitted=0, limits=server.ServerLimits(max_queued=2))
    admit, release = server.GrammarResponseGenerator.admit, server.GrammarResponseGenerator.release
    assert admit(generator) and admit(generator) and not admit(generator)
    release(generator)
    assert admit(generator) and not admit(generator)
    import argparse

    parser = argparse.ArgumentParser()
    server.add_serve_arguments(parser)
    args = parser.parse_args([])
    assert args.max_queued == server.DEFAULT_MAX_QUEUED and args.api_key == [] and args.api_key_file is None
    assert parser.parse_args(["--api-key", "a", "--api-key", "b"]).api_key == ["a", "b"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-queued", "0"])
