"""Write the hash scheme's test vectors: ``python tests/vectors/generate.py``.

Each vector is a payload's JSON text as a producer sends it, its canonical form and the
hex SHA-256 of that form. The file is checked against this library, the `rfc8785` and
`jcs` Python packages and the JavaScript `canonicalize` package (tests/unit/
test_hash_vectors.py), so regenerate it only to add vectors, never to change one.

Integers beyond +-(2**53 - 1) are kept out: this scheme writes them exactly, RFC 8785
implementations read them as doubles (producers in JavaScript send such ids as strings).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from inbox_middleware._core.canonical import canonical_json, loads

OUT = Path(__file__).resolve().parents[2] / "docs" / "reference" / "hash-vectors.json"

# RFC 8785 Appendix B: IEEE 754 doubles (as hex) and how ECMAScript writes them.
APPENDIX_B = [
    "0000000000000000", "8000000000000000", "0000000000000001", "8000000000000001",
    "7fefffffffffffff", "ffefffffffffffff", "4340000000000000", "c340000000000000",
    "4430000000000000", "44b52d02c7e14af5", "44b52d02c7e14af6", "44b52d02c7e14af7",
    "444b1ae4d6e2ef4e", "444b1ae4d6e2ef4f", "444b1ae4d6e2ef50", "3eb0c6f7a0b5ed8c",
    "3eb0c6f7a0b5ed8d", "41b3de4355555553", "41b3de4355555554", "41b3de4355555555",
    "41b3de4355555556", "41b3de4355555557", "becbf647612f3696", "43143ff3c1cb0959",
    "4415af1d78b58c3f",
]  # fmt: skip


def _double(hex_bits: str) -> str:
    """The double's JSON text: Python's repr, which reads back as the same double."""
    value = struct.unpack(">d", bytes.fromhex(hex_bits))[0]
    return repr(value)


CASES: list[tuple[str, str]] = [
    (
        "rfc8785-3.2.2",
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, '
        '0.000000000000000000000000001], "string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022'
        '\\u005c\\\\\\"\\/", "literals": [null, true, false]}',
    ),
    (
        "rfc8785-3.2.3-key-order",
        '{"\\u20ac": "Euro Sign", "\\r": "Carriage Return", '
        '"\\ufb33": "Hebrew Letter Dalet With Dagesh", "1": "One", "\\ud83d\\ude00": '
        '"Emoji: Grinning Face", "\\u0080": "Control", "\\u00f6": "Latin Small Letter O With '
        'Diaeresis"}',
    ),
    ("key-order-is-not-sorted-by-code-point", '{"\\ufb00": 1, "\\ud83d\\ude00": 2}'),
    ("white-space-and-key-order", '{ "b" : 2 ,\n  "a" : [ 1 , 2 ] }'),
    ("empty-containers", '{"a": {}, "b": [], "c": ""}'),
    ("literals", "[null, true, false]"),
    ("a-scalar-body", '"just text"'),
    ("number-spellings-of-ten", "[10, 10.0, 1e1, 1E+1, 100e-1]"),
    ("negative-zero", "[-0, -0.0, 0e5]"),
    ("two-to-the-sixtieth-as-a-double", "1152921504606846976.0"),
    ("more-digits-than-a-double-holds", "100.00000000000000001"),
    ("exponent-boundaries", "[1e20, 1e21, 1e-6, 1e-7, 123e-20, 0.1, 0.3, 1.5e300]"),
    ("largest-safe-integers", "[9007199254740991, -9007199254740991]"),
    ("not-unicode-normalised", '["e\\u0301", "\\u00e9", "\\ufb33"]'),
    ("escapes", '"\\u0000\\u0001\\b\\t\\n\\u000b\\f\\r\\u001f \\" \\\\ / \\u007f \\u2028"'),
    ("non-ascii-as-utf-8", '{"name": "Zoë Smith", "city": "Zürich", "emoji": "😀"}'),
    ("dramatiq-actor-form", '{"actor": "add_credit", "args": {"account_id": 7, "amount": 10}}'),
    (
        "order-event",
        '{"order_id": "ord-42", "customer": {"id": 1234, "email": '
        '"z@example.com"}, "lines": [{"sku": "A-1", "qty": 2, "price": 9.99}, {"sku": "B-7", '
        '"qty": 1, "price": 120.5}], "total": "140.48", "currency": "EUR"}',
    ),
    ("deep-nesting", "[" * 40 + '{"x": 1}' + "]" * 40),
    *((f"rfc8785-appendix-b-{bits}", _double(bits)) for bits in APPENDIX_B),
]


def vector(name: str, text: str) -> dict[str, str]:
    canonical = canonical_json(loads(text))
    return {
        "name": name,
        "json": text,
        "canonical": canonical.decode("utf-8"),
        "sha256": hashlib.sha256(canonical).hexdigest(),
    }


def main() -> None:
    document = {
        "description": (
            "inbox-middleware payload hash test vectors: json is the payload's JSON text as "
            "sent; canonical its RFC 8785 form; sha256 the hex SHA-256 of canonical's UTF-8 "
            "bytes (the digest the inbox stores for a FastStream JSON body)."
        ),
        "vectors": [vector(name, text) for name, text in CASES],
    }
    OUT.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
