"""`format`: known valid and invalid strings, and sampled strings checked by independent validators."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import uuid

import pytest
from schema_fsm import ByteDFA, format_checker, seeded

from grammar_mlx.regex.syntax import to_regex
from grammar_mlx.schema import schema_to_regex
from grammar_mlx.schema.formats import STRING_FORMATS, format_language

CASES = {
    "date": (["2020-02-29", "2000-02-29", "0001-01-01", "1999-12-31"],
             ["2021-02-29", "1900-02-29", "0000-01-01", "2021-13-01", "2021-04-31", "2021-1-01", "20210101"]),
    "time": (["12:00:00Z", "23:59:59.999+05:30", "00:00:00z", "08:30:06-08:00"],
             ["24:00:00Z", "12:60:00Z", "12:00:00", "12:00:00+24:00", "23:59:60Z"]),
    "date-time": (["2020-01-01T00:00:00Z", "1963-06-19t08:30:06.283185z"],
                  ["2020-01-01 00:00:00Z", "2020-02-30T00:00:00Z"]),
    "duration": (["P1Y", "P4W", "PT1H", "P1DT2H", "P1Y2M3DT4H5M6S", "PT0S"],
                 ["P", "PT", "P1Y1D", "PT1H1S", "1Y", "P1W1D"]),
    "email": (["a@b.c", "joe.bloggs@example.com", "x+y@sub.example.co", "joe.bloggs@[127.0.0.1]",
               "joe.bloggs@[IPv6:::1]", '"joe bloggs"@example.com', '"joe..bloggs"@example.com', '"a\\"b"@c.d'],
              ["a..b@c.d", ".a@b.c", "a@", "@b.c", "a b@c.d", "joe.bloggs@[127.0.0.300]", "a@[::1]",
               "a@[IPv6:1]", '"a"b"@c.d', '"a\u00e9"@c.d']),
    "hostname": (["example.com", "a", "a--b.com", "a-b.c-d.e", "a" * 63],
                 ["-a.com", "a_b.com", "a..b", "a" * 64, "a.b.c.d.e", "xn--nnx388a.com", "ab--cd.com"]),
    "ipv4": (["0.0.0.0", "192.168.1.255"], ["256.0.0.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"]),
    "ipv6": (["::", "::1", "1::", "1:2:3:4:5:6:7:8", "::ffff:1.2.3.4", "fe80::1"],
             ["1:2:3:4:5:6:7:8:9", "1::2::3", "12345::", "fe80::1%eth0", ":1:2"]),
    "uri": (["http://x.com/a?b#c", "mailto:a@b.c", "urn:isbn:0451450523", "http://[::1]:80/", "a:",
             "http://[v1.test]/", "http://[V1.fe]", "http://[vF.a:b]:8/"],
            ["//x.com", "http://a b", "1http://x", "/relative", "http://[v1.]/", "http://[vz.a]/", "http://[v.a]/"]),
    "uri-reference": (["//x.com", "a/b", "#frag", "", "../x?y"], ["a b", "%zz"]),
    "iri": (["http://ƒøø.ß.com/é", "http://[V1.fe]/é"], ["http://a b", "http://[v1.é]/"]),
    "uuid": (["2eb8aa08-aa98-11ea-b4aa-73b441d16380"], ["2eb8aa08aa9811eab4aa73b441d16380", "2eb8aa08-aa98-11ea-b4aa"]),
    "json-pointer": (["", "/a/b", "/~0/~1"], ["a", "/~2"]),
    "relative-json-pointer": (["0", "1/a", "2#"], ["-1", "01", "/a"]),
    "uri-template": (["http://x/{a}/{+b*}{?c,d:3}"], ["{a", "http://x/{}"]),
    "byte": (["", "YWJj", "YWI=", "YQ=="], ["YWJ", "Y===", "a b"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_known_strings(name):
    compiled = re.compile(to_regex(format_language(name)))
    valid, invalid = CASES[name]
    for s in valid:
        assert compiled.fullmatch(s), (name, s)
    for s in invalid:
        assert not compiled.fullmatch(s), (name, s)


def test_every_format_has_cases():
    assert set(STRING_FORMATS) - {"datetime", "ip-address", "host-name", "url", "iri-reference"} <= set(CASES)


def _check_date(s):
    datetime.date.fromisoformat(s)


def _check_date_time(s):
    datetime.datetime.fromisoformat(s.upper().replace("Z", "+00:00"))


def _check_time(s):
    _check_date_time("1970-01-01T" + s)


def _check_ipv6(s):
    ipaddress.IPv6Address(s)


def _check_ipv4(s):
    ipaddress.IPv4Address(s)


def _check_uuid(s):
    uuid.UUID(s)


CHECKERS = {"date": _check_date, "date-time": _check_date_time, "time": _check_time, "ipv6": _check_ipv6,
            "ipv4": _check_ipv4, "uuid": _check_uuid}


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_sampled_strings_pass_independent_validators(name):
    dfa = ByteDFA(schema_to_regex({"type": "string", "format": name}).regex)
    rng = seeded(7)
    for _ in range(200):
        CHECKERS[name](json.loads(dfa.sample(rng)))


def test_sampled_strings_pass_jsonschema_format_checker():
    jsonschema = pytest.importorskip("jsonschema")
    checker = format_checker(jsonschema.Draft202012Validator)
    rng = seeded(11)
    for name in ("email", "json-pointer", "relative-json-pointer", "date", "time", "date-time", "ipv4", "ipv6"):
        dfa = ByteDFA(schema_to_regex({"type": "string", "format": name}).regex)
        for _ in range(60):
            value = json.loads(dfa.sample(rng))
            assert checker.conforms(value, name), (name, value)


def test_unknown_format_constrains_nothing_and_is_not_reported():
    result = schema_to_regex({"type": "string", "format": "textarea"})
    assert result.unenforced == ()
    assert result.regex == schema_to_regex({"type": "string"}).regex


def test_unenforceable_standard_formats_are_reported():
    result = schema_to_regex({"type": "string", "format": "regex"})
    assert [(u.keyword, u.pointer) for u in result.unenforced] == [("format", "")]


def test_integer_formats_bound_the_range():
    dfa = ByteDFA(schema_to_regex({"type": "array", "items": {"type": "integer", "format": "int32"}}).regex)
    assert dfa.accepts("[2147483647,-2147483648]")
    assert not dfa.accepts("[2147483648]")
