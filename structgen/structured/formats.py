"""Format checks `jsonschema` skips without optional packages (rfc3987, rfc3339-validator, fqdn...).

Without them `jsonschema` treats "uri", "date-time" and the like as annotations and reports any string valid,
so an output that breaks them would be presented as valid. These follow the RFC grammars closely enough to
reject what is plainly wrong (no scheme, spaces, a 25th hour, a 30th of February).
"""

from __future__ import annotations

import datetime
import re

import jsonschema

_DATE_TIME = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))$"
)
_TIME = re.compile(r"^(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))$")
_DURATION = re.compile(r"^P(?!$)(\d+W|(\d+Y)?(\d+M)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+S)?)?)$")
# RFC 3986: a scheme, then only URI characters (percent-escapes included); IRIs also allow non-ASCII.
_URI_CHARS = r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2}"
_URI = re.compile(rf"^[A-Za-z][A-Za-z0-9+.\-]*:(?:{_URI_CHARS})*$")
_URI_REFERENCE = re.compile(rf"^(?:{_URI_CHARS})*$")
_IRI = re.compile(rf"^[A-Za-z][A-Za-z0-9+.\-]*:(?:{_URI_CHARS}|[^\x00-\x7f])*$")
_IRI_REFERENCE = re.compile(rf"^(?:{_URI_CHARS}|[^\x00-\x7f])*$")
_HOSTNAME_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_JSON_POINTER = re.compile(r"^(?:/(?:[^~/]|~[01])*)*$")
_RELATIVE_JSON_POINTER = re.compile(r"^(?:0|[1-9][0-9]*)(?:#|(?:/(?:[^~/]|~[01])*)*)$")


def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    m = _DATE_TIME.match(value)
    if not m:
        return False
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    try:
        datetime.date(year, month, day)
    except ValueError:
        return False
    offset_ok = m.group(9) is None or (int(m.group(9)) <= 23 and int(m.group(10)) <= 59)
    return hour <= 23 and minute <= 59 and second <= 60 and offset_ok


def _time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    m = _TIME.match(value)
    return bool(m) and int(m.group(1)) <= 23 and int(m.group(2)) <= 59 and int(m.group(3)) <= 60


def _hostname(value: object) -> bool:
    if not isinstance(value, str):
        return True
    name = value[:-1] if value.endswith(".") else value
    return 0 < len(name) <= 253 and all(_HOSTNAME_LABEL.match(label) for label in name.split("."))


def _pattern_check(pattern: re.Pattern[str]):  # type: ignore[no-untyped-def]
    return lambda value: not isinstance(value, str) or pattern.match(value) is not None


_CHECKS = {
    "date-time": _date_time,
    "time": _time,
    "duration": _pattern_check(_DURATION),
    "uri": _pattern_check(_URI),
    "uri-reference": _pattern_check(_URI_REFERENCE),
    "iri": _pattern_check(_IRI),
    "iri-reference": _pattern_check(_IRI_REFERENCE),
    "hostname": _hostname,
    "json-pointer": _pattern_check(_JSON_POINTER),
    "relative-json-pointer": _pattern_check(_RELATIVE_JSON_POINTER),
}


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's draft 2020-12 checker, with the checks above for the formats it would otherwise skip.
    (Not `FormatChecker()`: its "time" is draft 3's, which refuses an RFC 3339 offset.)"""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
    for name, check in _CHECKS.items():
        if name not in checker.checkers:
            checker.checks(name)(check)
    return checker
