"""HTTP/1.1 as the session server speaks it, and the checks on what a request carries.

Just enough HTTP for clients that already speak it (keep-alive, Content-Length bodies),
with a bound on every header, body and wait. Errors are shaped as OpenAI's are,
`{"error": {"message", "type", "param"}}`, `param` naming the offending field, so that a
client reads a refusal from this server as it reads one from vLLM."""

import asyncio
import base64
import binascii
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable

log = logging.getLogger("envsessions")

# The tools a session runs, each with its fields: (type, required).
TOOLS = {
    "run": {"command": (str, True), "timeout": ((int, float), False)},
    "read": {"path": (str, True)},
    "write": {"path": (str, True), "content": (str, True)},
    "archive": {},
}
SESSION_ROUTE = re.compile(r"/v1/sessions/([A-Za-z0-9_-]{1,64})(/call)?")
SNAPSHOT_ROUTE = re.compile(r"/v1/snapshots/([^/]{1,200})")
_REASONS = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    410: "Gone",
    422: "Unprocessable Content",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}

# method, target, headers (names lowercased), body, whether to keep the connection
Request = tuple[str, str, dict[str, str], bytes, bool]
Dispatch = Callable[[str, str, dict[str, str], bytes], Awaitable[tuple[int, dict]]]


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, **more: str):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.more = more

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": error | self.more}


def invalid(message: str, param: str | None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param)


async def converse(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    dispatch: Dispatch,
    idle_seconds: float,
    max_body_bytes: int,
) -> None:
    """Answers one connection's requests, each by `dispatch`, until it closes or idles."""
    try:
        while True:
            request = None
            try:
                request = await read_request(reader, idle_seconds, max_body_bytes)
                if request is None:
                    return
                method, target, headers, body, keep = request
                status, reply = await dispatch(method, target, headers, body)
            except HttpError as error:
                # After a request that could not be read, the stream is out of step.
                status, reply = error.status, error.body()
                keep = request is not None and request[4] and error.status < 500
            except Exception:  # nothing a client sends may take the server down
                log.exception("a request failed")
                status, keep = 500, False
                reply = {"error": {"message": "internal error", "type": "server_error"}}
            writer.write(_response(status, reply, keep))
            await writer.drain()
            if not keep:
                return
    except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()


def _response(status: int, reply: dict, keep: bool) -> bytes:
    data = json.dumps(reply).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n"
    )
    return head.encode() + data


async def read_request(
    reader: asyncio.StreamReader, idle_seconds: float, max_body_bytes: int
) -> Request | None:
    """The next request, or None once the client has closed or idled."""
    head = await _read_head(reader, idle_seconds)
    if head is None:
        return None
    method, target, version, headers = _parse_head(head)
    if "transfer-encoding" in headers:
        raise invalid("send a Content-Length body, not chunks", "Transfer-Encoding")
    length = headers.get("content-length", "0")
    if not length.isdigit():
        raise invalid("must be a non-negative integer", "Content-Length")
    if int(length) > max_body_bytes:
        raise HttpError(
            413,
            f"the body is over {max_body_bytes} bytes",
            "invalid_request_error",
            "Content-Length",
        )
    try:
        body = await asyncio.wait_for(reader.readexactly(int(length)), idle_seconds)
    except (asyncio.IncompleteReadError, TimeoutError):
        raise invalid("the body is shorter than its length", "Content-Length") from None
    keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    return method, target, headers, body, keep


async def _read_head(reader: asyncio.StreamReader, idle_seconds: float) -> bytes | None:
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle_seconds)
    except asyncio.IncompleteReadError as error:
        if error.partial.strip():
            raise invalid("the request ended inside its header", None) from None
        return None
    except asyncio.LimitOverrunError:
        raise HttpError(431, "the request header is too large", "invalid_request_error") from None
    except TimeoutError:
        return None


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """The request line's method, target and version, and the headers by lowercase name."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise invalid("malformed request line", None)
    method, target, version = parts
    headers = {}
    for line in lines[1:]:
        if line:
            name, colon, value = line.partition(":")
            if not colon:
                raise invalid("malformed header line", None)
            headers[name.strip().lower()] = value.strip()
    return method, target, version, headers


def only(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise HttpError(405, f"{method} {path} is not served", "invalid_request_error")


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def json_object(body: bytes) -> dict:
    try:
        value = json.loads(body or b"{}")
    except (ValueError, RecursionError):
        raise invalid("the body is not valid JSON", "body") from None
    if not isinstance(value, dict):
        raise invalid("the body must be a JSON object", "body")
    return value


def no_unknown(value: dict, known: set, prefix: str) -> None:
    for name in value:
        if name not in known:
            raise invalid(f"unknown field {name!r}", f"{prefix}{name}")


def tool_request(body: dict) -> dict:
    tool = body.get("tool")
    if tool not in TOOLS:
        raise invalid(f"tool must be one of {sorted(TOOLS)}", "tool")
    fields = TOOLS[tool]
    no_unknown(body, {"tool", *fields}, "")
    for name, (kind, required) in fields.items():
        if name not in body:
            if required:
                raise invalid(f"{tool} needs {name}", name)
        elif not isinstance(body[name], kind) or isinstance(body[name], bool):
            raise invalid(f"{name} has the wrong type", name)
    if "timeout" in body and not (number(body["timeout"]) and body["timeout"] > 0):
        raise invalid("timeout must be a positive number of seconds", "timeout")
    return body


def has_control(text: str) -> bool:
    """Whether `text` holds a control character (C0, DEL or C1), as no file's path may: a
    newline in a name forges lines in whatever lists the tree. (A tool call's path is
    the sandbox's `envserver` to refuse, which runs alone there.)"""
    return any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text)


def decode_files(files, disk_bytes: int) -> dict[str, bytes]:
    """A task's starting files, decoded; paths are relative and stay inside the tree."""
    if not isinstance(files, dict):
        raise invalid("files must map relative paths to base64", "files")
    decoded, total = {}, 0
    for path, content in files.items():
        parts = path.split("/")
        if path.startswith("/") or has_control(path) or any(p in ("", ".", "..") for p in parts):
            raise invalid("a file's path must be relative and plain", f"files.{path}")
        try:
            decoded[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise invalid("not base64", f"files.{path}") from None
        total += len(decoded[path])
    if total > disk_bytes:
        raise invalid(f"the files are over the session's {disk_bytes} bytes of disk", "files")
    return decoded
