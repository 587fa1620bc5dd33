"""The format checks finished outputs are judged by: `jsonschema`'s own, as the standard's libraries make them.

Without its optional packages `jsonschema` treats "date-time", "uri", "uri-template", "duration" and the like as
annotations and reports any string valid, so an output that breaks them would be presented as valid. structgen
depends on `jsonschema[format-nongpl]` (rfc3339-validator, rfc3986-validator, rfc3987-syntax, isoduration, fqdn,
idna, jsonpointer, uri-template, webcolors), which checks every format of draft 2020-12; earlier hand-written
checks here were looser than those libraries (a `uri-reference` of "://" passed, `uri-template` went unchecked).

`format_checker()` refuses a broken install (a package missing): the alternative is outputs reported valid that
are not. The grammars are unchanged by this: formats they do not enforce are checked here on the output, and the
relaxed path retries an output that fails.
"""

from __future__ import annotations

import jsonschema

# Every format draft 2020-12 defines (the "format" vocabulary), with the package that checks it where
# `jsonschema` needs one; None: `jsonschema` checks it itself.
DRAFT_2020_12_FORMATS: dict[str, str | None] = {
    "date-time": "rfc3339-validator",
    "date": None,
    "time": "rfc3339-validator",
    "duration": "isoduration",
    "email": None,
    "idn-email": None,
    "hostname": "fqdn",
    "idn-hostname": "idna",
    "ipv4": None,
    "ipv6": None,
    "uri": "rfc3986-validator",
    "uri-reference": "rfc3986-validator",
    "iri": "rfc3987-syntax",
    "iri-reference": "rfc3987-syntax",
    "uuid": None,
    "uri-template": "uri-template",
    "json-pointer": "jsonpointer",
    "relative-json-pointer": "jsonpointer",
    "regex": None,
}


class FormatCheckError(RuntimeError):
    """The install lacks a package `jsonschema` needs to check a format."""


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's draft 2020-12 checker (not `FormatChecker()`, whose "time" is draft 3's and refuses an RFC
    3339 offset), checked to cover every format of the draft."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)
    missing = sorted(
        {
            package or "jsonschema"
            for name, package in DRAFT_2020_12_FORMATS.items()
            if name not in checker.checkers
        }
    )
    if missing:
        raise FormatCheckError(
            "outputs could not be checked against every JSON Schema format: missing "
            f"{', '.join(missing)}; install them with pip install 'jsonschema[format-nongpl]'"
        )
    return checker
