"""Who may use the server (docs/server.md, "Access"): API keys, the bounded queue, the warning for a
server open to the network. Two real servers (embedded SmolLM2) on every address, one with keys from
each source and `--max-queued 1`, one without a key; driven by the real `openai` client and raw HTTP."""

from __future__ import annotations

import base64
import http.client
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import Server

KEY = "sk-test-right-0123456789"
FILE_KEY = "sk-test-from-file-4567"
ENV_KEY = "sk-test-from-env-89"
WRONG = "sk-test-wrong-0123456789"
DIGITS = {"type": "regex", "regex": "[0-9]{64}"}  # decoded a token at a time: a request that takes a while


@pytest.fixture(scope="module")
def access_servers(smollm_path, tmp_path_factory):
    pytest.importorskip("openai", reason="the openai client is a test extra")
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"# the team's key\n{FILE_KEY}\n")
    keyed = Server("keyed", "--host", "0.0.0.0", "--api-key", KEY, "--api-key-file", str(keys), "--max-queued", "1",
                   "--max-tokens", "200", "--log-level", "DEBUG", "--no-preload-json-object",
                   env={"GRAMMAR_MLX_API_KEY": ENV_KEY})
    open_ = Server("open", "--host", "0.0.0.0", "--no-preload-json-object")
    try:
        keyed.wait_ready()
        open_.wait_ready()
        yield {"keyed": keyed, "open": open_}
    finally:
        for server in (keyed, open_):
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
                server.proc.wait(30)
        log = keyed.log_text()
        keyed.stop()
        open_.stop()
        # Whatever was logged, at DEBUG, over every test of this module: never a key.
        for key in (KEY, FILE_KEY, ENV_KEY, WRONG):
            assert key not in log, f"{key} in the log"


def address(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def request(server: Server, method: str, path: str, body: dict | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(*address(server), timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


CHAT = {"model": "smollm", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
COMPLETION = {"model": "smollm", "prompt": "Hi", "max_tokens": 4}
REFUSED_HEADERS = {
    "no header": {},
    "a wrong key": {"Authorization": f"Bearer {WRONG}"},
    "the key with a trailing space": {"Authorization": f"Bearer {KEY} "},
    "a Basic header": {"Authorization": "Basic " + base64.b64encode(f"{KEY}:".encode()).decode()},
    "no scheme": {"Authorization": KEY},
}


@pytest.mark.slow
def test_the_warning_line_is_printed_for_an_open_address_without_a_key(access_servers):
    warnings = [line for line in access_servers["open"].log_text().splitlines() if "without an API key" in line]
    assert len(warnings) == 1, access_servers["open"].tail()
    assert warnings[0].startswith("warning: listening on 0.0.0.0:") and "--api-key" in warnings[0]
    assert "without an API key" not in access_servers["keyed"].log_text()


@pytest.mark.slow
def test_without_a_key_everything_works_as_before(access_servers):
    client = access_servers["open"].client()
    assert [m.id for m in client.models.list().data]
    assert client.chat.completions.create(model="smollm", messages=CHAT["messages"], max_tokens=4).choices
    assert request(access_servers["open"], "POST", "/v1/completions", COMPLETION)[0] == 200


@pytest.mark.slow
@pytest.mark.parametrize("why", list(REFUSED_HEADERS))
def test_a_missing_or_wrong_key_is_a_401_on_every_endpoint(access_servers, why):
    server = access_servers["keyed"]
    for method, path, body in (("POST", "/v1/chat/completions", CHAT), ("POST", "/chat/completions", CHAT),
                               ("POST", "/v1/completions", COMPLETION), ("GET", "/v1/models", None),
                               ("POST", "/v1/nowhere", CHAT)):
        status, headers, raw = request(server, method, path, body, REFUSED_HEADERS[why])
        assert status == 401, (why, path, raw)
        error = json.loads(raw)["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key"), error
        assert KEY not in error["message"] and WRONG not in error["message"]
        assert headers.get("WWW-Authenticate") == "Bearer"


@pytest.mark.slow
def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(access_servers):
    import openai

    with pytest.raises(openai.AuthenticationError) as info:
        access_servers["keyed"].client(WRONG).chat.completions.create(model="smollm", messages=CHAT["messages"],
                                                                      max_tokens=4)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"


@pytest.mark.slow
def test_a_large_body_with_a_wrong_key_is_refused_before_it_is_read(access_servers):
    server = access_servers["keyed"]
    size = 10 * 2**20
    with socket.create_connection(address(server), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {WRONG}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode())
        sock.sendall(b"{" + b" " * 65535)  # a sliver of the 10 MB: the answer comes without the rest
        started = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        assert time.monotonic() - started < 20
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 401") or head.startswith(b"HTTP/1.1 401"), head
        assert b"Connection: close" in head
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(15)
        while sock.recv(65536):  # the server closes its end
            pass
    # It goes on serving.
    assert request(server, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200


@pytest.mark.slow
def test_the_right_keys_are_served_on_every_endpoint_and_health_needs_none(access_servers):
    server = access_servers["keyed"]
    assert request(server, "GET", "/health")[0] == 200
    for key in (KEY, FILE_KEY, ENV_KEY):
        client = server.client(key)
        assert [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(model="smollm", messages=CHAT["messages"], max_tokens=30,
                                               response_format={"type": "regex", "regex": "[a-z]{3,8}"})
        assert 3 <= len(reply.choices[0].message.content) <= 8
    client = server.client(KEY)
    assert client.completions.create(model="smollm", prompt="Hi", max_tokens=4).choices
    chunks = list(client.chat.completions.create(model="smollm", messages=CHAT["messages"], max_tokens=30,
                                                 response_format={"type": "regex", "regex": "[a-z]{3,8}"},
                                                 stream=True))
    assert 3 <= len("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)) <= 8


@pytest.mark.slow
def test_past_max_queued_a_request_gets_a_429_and_the_admitted_one_is_unaffected(access_servers):
    server = access_servers["keyed"]
    auth = {"Authorization": f"Bearer {KEY}"}
    conn = http.client.HTTPConnection(*address(server), timeout=300)
    body = {**CHAT, "max_tokens": 200, "stream": True, "response_format": DIGITS}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=auth)
    slow = conn.getresponse()
    assert slow.status == 200
    first = slow.fp.readline()  # generation has started: the request is admitted and running
    assert first.startswith(b"data: ") or first.startswith(b":")

    def burst(_):
        return request(server, "POST", "/v1/chat/completions", CHAT, auth)

    with ThreadPoolExecutor(5) as pool:
        refused = list(pool.map(burst, range(5)))
    for status, headers, raw in refused:
        assert status == 429, raw
        assert int(headers["Retry-After"]) >= 1
        error = json.loads(raw)["error"]
        assert error["code"] == "rate_limit_exceeded" and "--max-queued 1" in error["message"]
    rest = first + slow.read()
    conn.close()
    events = [line[len(b"data: "):] for line in rest.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if json.loads(e).get("choices"))
    assert len(text) == 64 and text.isdigit()  # complete and correct
    assert burst(0)[0] == 200  # the next one is served
