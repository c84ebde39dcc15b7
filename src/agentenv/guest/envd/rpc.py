"""The Connect protocol with the JSON codec, as the E2B SDKs use it (docs/e2b-api.md §3.1).

Unary calls carry one JSON message; streams carry envelopes (1 byte flags + 4 byte big-endian
length + payload) and end with an end-of-stream envelope that holds the error, if any.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from typing import Any

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02

CODE_TO_HTTP_STATUS: dict[str, int] = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class RpcError(Exception):
    """An error with a Connect code; becomes an error body (unary) or an error EOS (stream)."""

    def __init__(self, code: str, message: str) -> None:
        if code not in CODE_TO_HTTP_STATUS:
            raise ValueError(f"unknown Connect code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return CODE_TO_HTTP_STATUS[self.code]

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def encode_envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def end_of_stream(error: RpcError | None = None) -> bytes:
    return encode_envelope({"error": error.to_json()} if error else {}, FLAG_END_STREAM)


class EnvelopeDecoder:
    """Splits a byte stream into envelopes; feed it chunks as they arrive."""

    def __init__(self, max_message_bytes: int) -> None:
        self._buffer = bytearray()
        self._max = max_message_bytes

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        envelopes: list[tuple[int, bytes]] = []
        while len(self._buffer) >= 5:
            flags, length = struct.unpack_from(">BI", self._buffer)
            if length > self._max:
                raise RpcError("resource_exhausted", f"message of {length} bytes is too large")
            if len(self._buffer) < 5 + length:
                break
            payload = bytes(self._buffer[5 : 5 + length])
            del self._buffer[: 5 + length]
            if flags & FLAG_COMPRESSED:
                raise RpcError("internal", "compressed envelopes are not supported")
            envelopes.append((flags, payload))
        return envelopes

    @property
    def pending(self) -> int:
        return len(self._buffer)


def parse_message(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload) if payload.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RpcError("invalid_argument", f"malformed JSON message: {exc}") from None
    if not isinstance(message, dict):
        raise RpcError("invalid_argument", "a message must be a JSON object")
    return message


def snake_to_camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def field(message: dict[str, Any] | None, name: str, default: Any = None) -> Any:
    """A field by its proto (snake_case) name, also accepting the JSON lowerCamelCase form."""
    if not message:
        return default
    camel = snake_to_camel(name)
    if camel in message and message[camel] is not None:
        return message[camel]
    value = message.get(name)
    return default if value is None else value


def as_object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RpcError("invalid_argument", f"{what} must be an object")
    return value


def as_str(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RpcError("invalid_argument", f"{what} must be a string")
    return value


def as_bool(value: Any, what: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RpcError("invalid_argument", f"{what} must be a boolean")
    return value


def as_uint(value: Any, what: str) -> int:
    """uint32/int64 fields: JSON numbers, or decimal strings (proto3 JSON allows both)."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise RpcError("invalid_argument", f"{what} must be an integer")
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise RpcError("invalid_argument", f"{what} must be an integer") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or value < 0:
        raise RpcError("invalid_argument", f"{what} must be a non-negative integer")
    return value


def as_str_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise RpcError("invalid_argument", f"{what} must be a map of strings")
    return value


def decode_bytes(value: Any, what: str) -> bytes:
    """proto3 JSON bytes: standard base64; URL-safe and unpadded forms are accepted too."""
    if value is None:
        return b""
    if not isinstance(value, str):
        raise RpcError("invalid_argument", f"{what} must be base64 text")
    text = value.replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RpcError("invalid_argument", f"{what} is not valid base64") from None


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def same_secret(given: str, expected: str) -> bool:
    """Compare a secret in constant time (hmac.compare_digest would load OpenSSL for just this)."""
    a, b = given.encode(), expected.encode()
    difference = len(a) ^ len(b)
    for x, y in zip(a.ljust(len(b), b"\0")[: len(b)], b, strict=True):
        difference |= x ^ y
    return difference == 0
