"""grammar_mlx.server.access: the API keys, their check, the open-to-the-network warning."""

from __future__ import annotations

import hmac

import pytest

from grammar_mlx.errors import InvalidArgumentError, InvalidRequestError
from grammar_mlx.server import access, error_response


def test_keys_from_flags_file_and_environment(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \nsk-flag\n")
    keys = access.load_api_keys(["sk-flag", "sk-two"], str(keys_file), {access.API_KEY_ENV: "sk-env"})
    assert keys == ("sk-flag", "sk-two", "sk-file-1", "sk-file-2", "sk-env")  # in order, once each
    assert access.load_api_keys([], None, {}) == ()
    assert access.load_api_keys([], None, {access.API_KEY_ENV: "  "}) == ()  # empty: no key


@pytest.mark.parametrize("keys, key_file, words", [
    (["sk bad"], None, "--api-key: an API key is one or more of"),
    ([""], None, "--api-key"),
    ([], "missing", "missing: cannot read it (FileNotFoundError"),
    ([], "empty", "holds no key"),
    ([], "spaced", "line 2"),
])
def test_bad_keys_are_refused_without_showing_them(tmp_path, keys, key_file, words):
    (tmp_path / "empty").write_text("# nothing\n\n")
    (tmp_path / "spaced").write_text("sk-ok\nsk secret\n")
    path = None if key_file is None else str(tmp_path / key_file)
    with pytest.raises(InvalidArgumentError) as info:
        access.load_api_keys(keys, path, {})
    assert words in str(info.value) and "secret" not in str(info.value)


def test_only_bearer_with_a_configured_key_exactly_is_authorized(monkeypatch):
    keys = ("sk-one", "sk-two")
    assert access.authorized("Bearer sk-one", keys) and access.authorized("Bearer sk-two", keys)
    for header in (None, "", "Bearer", "Bearer ", "Bearer sk-one ", "Bearer  sk-one", "bearer sk-one",
                   "Basic c2stb25lOg==", "sk-one", "Bearer sk-on", "Bearer sk-one2", "Bearer sk-onë"):
        assert not access.authorized(header, keys), header
    # Every key is compared in constant time, also after a match.
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(access.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    assert access.authorized("Bearer sk-one", keys) and compared == [b"sk-one", b"sk-two"]


def test_a_refused_key_is_an_openai_401_that_does_not_echo_it():
    access.check_authorization(None, ())  # no key configured: open
    access.check_authorization("Bearer sk-one", ("sk-one",))
    for header in (None, "Bearer sk-wrong"):
        with pytest.raises(InvalidRequestError) as info:
            access.check_authorization(header, ("sk-one",))
        status, body = error_response(info.value)
        assert status == 401 and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["code"] == "invalid_api_key" and "sk-" not in body["error"]["message"]


def test_the_warning_names_a_non_loopback_address_without_a_key():
    line = access.open_to_network_warning("0.0.0.0", 8080, ())
    assert line is not None and "0.0.0.0:8080" in line and "--api-key" in line and "\n" not in line
    assert "[::]:80" in (access.open_to_network_warning("::", 80, ()) or "")
    assert access.open_to_network_warning("0.0.0.0", 8080, ("sk-one",)) is None
    for host in ("127.0.0.1", "::1", "127.0.0.2", "localhost"):
        assert access.open_to_network_warning(host, 8080, ()) is None, host
