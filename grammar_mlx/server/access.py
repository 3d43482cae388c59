"""Who may use the server: API keys (`Authorization: Bearer KEY`), and the warning for a server open
to the network without one (docs/server.md, "Access").

Keys come from `--api-key` (repeatable), `--api-key-file` (one key a line; blank lines and lines
starting with `#` skipped) and the environment variable `GRAMMAR_MLX_API_KEY`, all of them valid at
once. With none, the server is open (its default host is loopback). A key is checked in constant
time against every configured key and never logged or echoed.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
from collections.abc import Iterable

from ..errors import InvalidArgumentError, InvalidRequestError

__all__ = ["API_KEY_ENV", "load_api_keys", "authorized", "check_authorization", "open_to_network_warning"]

API_KEY_ENV = "GRAMMAR_MLX_API_KEY"
# A bearer token's characters (RFC 6750's b64token, plus what API keys use): no spaces or controls.
_KEY = re.compile(r"[A-Za-z0-9\-._~+/=:]+")
_BEARER = "Bearer "


def _checked(key: str, where: str) -> str:
    if not _KEY.fullmatch(key):
        # The key itself is not shown: it may be a real key with a typo.
        raise InvalidArgumentError(f"{where}: an API key is one or more of A-Z a-z 0-9 - . _ ~ + / = : "
                                   f"(no spaces), got {len(key)} characters that are not")
    return key


def load_api_keys(keys: Iterable[str] = (), key_file: str | None = None,
                  environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """Every configured key, in order and without repeats: `keys` (`--api-key`), the lines of
    `key_file`, and `GRAMMAR_MLX_API_KEY` from `environ` (default `os.environ`; empty or unset: none).
    Raises `InvalidArgumentError` for a malformed key, an unreadable file or a file with no key."""
    found = [_checked(k, "--api-key") for k in keys]
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(f"--api-key-file {key_file}: cannot read it ({type(e).__name__}: {e})") from None
        from_file = [_checked(line, f"--api-key-file {key_file}, line {i}")
                     for i, line in enumerate(lines, 1) if line and not line.startswith("#")]
        if not from_file:
            raise InvalidArgumentError(f"--api-key-file {key_file} holds no key")
        found += from_file
    env = (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip()
    if env:
        found.append(_checked(env, API_KEY_ENV))
    return tuple(dict.fromkeys(found))


def authorized(header: str | None, keys: tuple[str, ...]) -> bool:
    """Whether an `Authorization` header value is `Bearer KEY` for one of `keys`, exactly (no other
    scheme, no extra spaces). Every key is compared, in constant time for its length."""
    if header is None or not header.startswith(_BEARER):
        return False
    given = header[len(_BEARER):].encode("utf-8", "surrogateescape")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key.encode())
    return ok


def check_authorization(header: str | None, keys: tuple[str, ...]) -> None:
    """Raise the 401 `invalid_api_key` when keys are configured and `header` holds none of them."""
    if keys and not authorized(header, keys):
        why = "no API key was given" if header is None else "the API key is not valid"
        raise InvalidRequestError(f"{why}: send Authorization: Bearer KEY with a key this server accepts",
                                  status=401, code="invalid_api_key")


def is_loopback(host: str) -> bool:
    """Whether a bound address only takes connections from this machine."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


def open_to_network_warning(host: str, port: int, keys: tuple[str, ...]) -> str | None:
    """The start-up warning line for a server bound to a non-loopback address without a key, or None."""
    if keys or is_loopback(host):
        return None
    shown = f"[{host}]" if ":" in host else host
    return (f"warning: listening on {shown}:{port} without an API key: anyone who can reach this address can use "
            f"the model; pass --api-key KEY or --api-key-file FILE (or set {API_KEY_ENV})")
