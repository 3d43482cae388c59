"""`format` as character-level patterns (full match, ECMA-262 syntax, parsed by `regex.syntax`).

Each pattern accepts only strings valid for its format (RFC 3339 dates and times with real calendar
days and no leap seconds, RFC 3986 URIs, RFC 4291 IPv6, ...); where a format's full language is not
regular or not worth its automaton, the pattern is a documented subset:

- `email`: a dot-atom or quoted local part, and a hostname domain or an IPv4 / IPv6 address
  literal (`[127.0.0.1]`, `[IPv6:::1]`; no RFC 5321 general address literals `[tag:...]`);
- `hostname`: at most 4 labels (total length <= 253 holds by construction), none an IDNA A-label
  (`xn--...`: its Punycode and IDNA 2008 rules are not regular).

Formats outside the JSON Schema vocabulary that users meet in the wild (OpenAPI's `int32`, `byte`, ...)
are here too; a format not known at all is an annotation (JSON Schema: "unknown formats are ignored")
and constrains nothing. `regex` is the only standard format whose meaning cannot be a regex; the front
end reports it as unenforced.
"""

from __future__ import annotations

from functools import cache

from ..regex.ecma import parse_ecma
from ..regex.syntax import Node as Regex
from ..regex.syntax import full_language

_D = "[0-9]"
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[13579][26]|[2468][048]|0[48])00)"
DATE = (
    f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    f"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)"
)
_OFFSET = "(?:[Zz]|[+\\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
TIME = f"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?{_OFFSET}"
DATE_TIME = f"{DATE}[Tt]{TIME}"
DURATION = (
    "P(?:(?:[0-9]+D|[0-9]+M(?:[0-9]+D)?|[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?)"
    "(?:T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S))?"
    "|T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)|[0-9]+W)"
)
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
IPV4 = f"(?:{_OCTET}\\.){{3}}{_OCTET}"
_H16 = "[0-9A-Fa-f]{1,4}"
_LS32 = f"(?:{_H16}:{_H16}|{IPV4})"
IPV6 = "(?:" + "|".join([
    f"(?:{_H16}:){{6}}{_LS32}",
    f"::(?:{_H16}:){{5}}{_LS32}",
    f"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
    f"(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}",
    f"(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}",
    f"(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
    f"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}",
    f"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
    f"(?:(?:{_H16}:){{0,6}}{_H16})?::",
]) + ")"
_LD, _LDH = "[A-Za-z0-9]", "[A-Za-z0-9\\-]"


def _label(longest: int) -> str:
    """An LDH label of 1..longest characters without "--" in positions 3-4 (RFC 5891 reserves that
    for A-labels, whose Punycode a regex cannot check: `xn--` labels are left out)."""
    short = f"{_LD}(?:{_LDH}{{0,2}}{_LD})?"
    long = f"{_LD}{_LDH}(?:{_LD}{_LDH}|\\-{_LD}){_LDH}{{0,{longest - 5}}}{_LD}"
    return f"(?:{short}|{long})"


_LABEL = _label(63)
# At most 4 labels, total length <= 253: a fourth label leaves 61 characters for the last one.
HOSTNAME = f"(?:(?:{_LABEL}\\.){{0,2}}{_LABEL}|(?:{_LABEL}\\.){{3}}{_label(61)})"
_ATEXT = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~\\-]"
# RFC 5321: a dot-atom or a quoted string (qtextSMTP, quoted-pairSMTP) before the @; a domain or an
# IPv4 / IPv6 address literal after it.
_QUOTED_LOCAL = '"(?:[ !#-\\[\\]-~]|\\\\[ -~])*"'
_ADDRESS_LITERAL = f"\\[(?:{IPV4}|IPv6:{IPV6})\\]"
EMAIL = f"(?:{_ATEXT}+(?:\\.{_ATEXT}+)*|{_QUOTED_LOCAL})@(?:(?:{_LABEL}\\.)*{_LABEL}|{_ADDRESS_LITERAL})"
UUID = "[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"
JSON_POINTER = "(?:/(?:[^/~]|~[01])*)*"
RELATIVE_JSON_POINTER = f"(?:0|[1-9][0-9]*)(?:#|{JSON_POINTER})"
BASE64 = "(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?"

# RFC 3986 (URI) and RFC 3987 (IRI: the same grammar with `ucschar` among the unreserved characters).
_UCSCHAR = ("\\u00A0-\\uD7FF\\uF900-\\uFDCF\\uFDF0-\\uFFEF\\u{10000}-\\u{1FFFD}\\u{20000}-\\u{2FFFD}"
            "\\u{30000}-\\u{3FFFD}\\u{E1000}-\\u{EFFFD}")


def _uri_grammar(iri: bool) -> tuple[str, str]:
    extra = _UCSCHAR if iri else ""
    pct = "%[0-9A-Fa-f]{2}"
    unreserved_sub = f"A-Za-z0-9\\-._~!$&'()*+,;={extra}"
    pchar = f"(?:[{unreserved_sub}:@]|{pct})"
    pchar_nc = f"(?:[{unreserved_sub}@]|{pct})"
    userinfo = f"(?:[{unreserved_sub}:]|{pct})*"
    reg_name = f"(?:[{unreserved_sub}]|{pct})*"
    ipv_future = "[vV][0-9A-Fa-f]+\\.[A-Za-z0-9\\-._~!$&'()*+,;=:]+"  # the same in RFC 3987 (no ucschar)
    host = f"(?:\\[(?:{IPV6}|{ipv_future})\\]|{IPV4}|{reg_name})"
    authority = f"(?:{userinfo}@)?{host}(?::[0-9]*)?"
    abempty = f"(?:/{pchar}*)*"
    absolute = f"/(?:{pchar}+(?:/{pchar}*)*)?"
    rootless = f"{pchar}+(?:/{pchar}*)*"
    noscheme = f"{pchar_nc}+(?:/{pchar}*)*"
    private = "\\uE000-\\uF8FF\\u{F0000}-\\u{FFFFD}\\u{100000}-\\u{10FFFD}" if iri else ""
    query = f"(?:{pchar}|[/?{private}])*"
    fragment = f"(?:{pchar}|[/?])*"
    tail = f"(?:\\?{query})?(?:#{fragment})?"
    absolute_uri = f"[A-Za-z][A-Za-z0-9+\\-.]*:(?://{authority}{abempty}|{absolute}|{rootless}|){tail}"
    relative = f"(?://{authority}{abempty}|{absolute}|{noscheme}|){tail}"
    return absolute_uri, f"(?:{absolute_uri}|{relative})"


URI, URI_REFERENCE = _uri_grammar(iri=False)
IRI, IRI_REFERENCE = _uri_grammar(iri=True)

_VARCHAR = "(?:[A-Za-z0-9_]|%[0-9A-Fa-f]{2})"
_VARSPEC = f"{_VARCHAR}(?:\\.?{_VARCHAR})*(?::[1-9][0-9]{{0,3}}|\\*)?"
URI_TEMPLATE = (
    f"(?:[!#$&()*+,\\-./0-9:;=?@A-Z\\[\\]_a-z~{_UCSCHAR}\\uE000-\\uF8FF]|%[0-9A-Fa-f]{{2}}"
    f"|\\{{[+#./;?&=,!@|]?{_VARSPEC}(?:,{_VARSPEC})*\\}})*"
)

STRING_FORMATS: dict[str, str] = {
    "date": DATE,
    "time": TIME,
    "date-time": DATE_TIME,
    "duration": DURATION,
    "email": EMAIL,
    "hostname": HOSTNAME,
    "ipv4": IPV4,
    "ipv6": IPV6,
    "uri": URI,
    "uri-reference": URI_REFERENCE,
    "iri": IRI,
    "iri-reference": IRI_REFERENCE,
    "uri-template": URI_TEMPLATE,
    "uuid": UUID,
    "json-pointer": JSON_POINTER,
    "relative-json-pointer": RELATIVE_JSON_POINTER,
    # Common outside the JSON Schema vocabulary (draft 3, OpenAPI, hand-written schemas).
    "byte": BASE64,
    "datetime": DATE_TIME,
    "ip-address": IPV4,
    "host-name": HOSTNAME,
    "url": URI,
}

# Formats whose pattern is a subset of the format (see above: host names, email address literals,
# leap seconds): a membership oracle (`Normalizer.members_only`) cannot read them.
NARROWED_FORMATS = frozenset({"email", "hostname", "host-name", "time", "date-time", "datetime"})

# Standard formats whose meaning this front end does not enforce (reported as unenforced).
UNENFORCED_FORMATS = {
    "regex": "a regex's syntax is not a regular language",
    "idn-email": "internationalized email addresses are not enforced",
    "idn-hostname": "internationalized host names (IDNA 2008) are not enforced",
}

# OpenAPI integer formats as inclusive ranges.
INTEGER_FORMATS: dict[str, tuple[int, int]] = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint8": (0, 2**8 - 1),
    "uint16": (0, 2**16 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}


@cache
def format_language(name: str) -> Regex:
    """The character-level AST (full match) of a format of `STRING_FORMATS` (KeyError for another name)."""
    language = full_language(parse_ecma(STRING_FORMATS[name]))
    _BUILT.add(id(language))  # kept alive by the cache: the id is never reused
    return language


_BUILT: set[int] = set()


def is_format_language(ast: Regex) -> bool:
    """Whether `ast` is the very AST `format_language` returned for some format (one built so far:
    an AST not built yet cannot be in hand), without parsing the formats not met."""
    return id(ast) in _BUILT
