"""Hypothesis-built ``POST /v1/chat/completions`` bodies, sent as raw bytes to a real gateway.

Valid bodies full of odd unicode, bodies nested 10,000 deep, strings up to and just over the body
limit, every field the gateway reads with a wrong type, duplicate keys, truncated JSON, bytes that
are not UTF-8, odd content types and odd ``X-Task-Id`` / ``X-Request-Id`` headers. Whatever comes
in: never a 500, every error in the OpenAI shape (with a clear message and, for a wrong field, the
field in ``param``), and afterwards the gateway is healthy and serves a normal request
(``stays_healthy``). Where the answer is known exactly (a valid body, a body over the limit, a
wrong type) the property says which.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.chat_input import ID_PATTERN
from tests.fuzz.conftest import (
    BODY_LIMIT,
    CHAT_KEY,
    MODELS,
    SLOW_OR_BIG,
    FuzzTarget,
    assert_well_formed,
    error_of,
    fuzz_config,
)
from tests.harness import Gateway, RedisServer

pytestmark = pytest.mark.usefixtures("stays_healthy")

PROPERTY = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=SLOW_OR_BIG,
)
"""Bounded and reproducible: the same examples on every run, nothing stored between runs."""
AUTH = {"authorization": f"Bearer {CHAT_KEY}"}
TASK_ID = re.compile(ID_PATTERN)


def post(
    target: FuzzTarget, body: bytes | Iterator[bytes], headers: dict[str, str] | None = None
) -> httpx.Response:
    return target.client.post("/v1/chat/completions", content=body, headers={**AUTH, **(headers or {})})


def checked(response: httpx.Response, what: str) -> httpx.Response:
    assert_well_formed(response.status_code, response.headers, response.content, what)
    return response


def assert_error(response: httpx.Response, status: int, code: str, what: str) -> dict[str, Any]:
    assert response.status_code == status, f"{what}: {response.status_code} {response.text[:500]}"
    error = error_of(response.content, what, status)
    assert error["code"] == code, f"{what}: {error}"
    return error


def assert_completion(response: httpx.Response, stream: bool, what: str) -> None:
    """A 200 with a whole ``chat.completion``, or an event stream that ends with ``[DONE]``."""
    assert response.status_code == 200, f"{what}: {response.status_code} {response.text[:500]}"
    if not stream:
        assert response.json()["object"] == "chat.completion", what
        return
    assert response.headers["content-type"].startswith("text/event-stream"), what
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]", f"{what}: {events[-3:]}"
    for event in events[:-1]:
        chunk = json.loads(event.removeprefix("data: "))
        assert "error" not in chunk, f"{what}: {chunk}"


# --- strategies ------------------------------------------------------------------------------

ODD_CHARACTERS = [
    "\x00",
    "\x1f",
    "\x7f",
    "\u202e",  # right-to-left override
    "\u200f",  # right-to-left mark
    "\u2066",  # left-to-right isolate
    "\u200d",  # zero-width joiner
    "\ufeff",  # byte order mark
    "\uffff",  # noncharacter
    "\u2028",  # line separator
    "e\u0301",  # combining acute
    "\U0001f600",
    "\U0001f469\u200d\U0001f4bb",
    "\U0010ffff",
    '"',
    "\\",
    "\ndata: [DONE]\n\n",
]
odd_text = st.lists(
    st.one_of(st.characters(codec="utf-8"), st.sampled_from(ODD_CHARACTERS)), max_size=20
).map("".join)
"""Any UTF-8 text (surrogates cannot be UTF-8: lone ones are sent as ``\\ud800`` escapes below)."""
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | odd_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text, inner, max_size=3),
    max_leaves=8,
)
content = st.one_of(
    odd_text,
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": odd_text}), min_size=1, max_size=3),
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": content}
)
CHAT_FIELDS = {"model", "messages", "stream", "max_tokens", "max_completion_tokens", "stream_options"}
unknown_fields = st.dictionaries(odd_text.filter(lambda key: key not in CHAT_FIELDS), json_values, max_size=3)


@st.composite
def valid_bodies(draw: st.DrawFn, models: tuple[str, ...] = ("mock",)) -> dict[str, Any]:
    body: dict[str, Any] = draw(unknown_fields)
    body["model"] = draw(st.sampled_from(models))
    body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans() | st.none())
    if draw(st.booleans()):
        body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(
            st.integers(1, 64) | st.none()
        )
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = draw(st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}))
    return body


def encode(body: Any, ascii_only: bool) -> bytes:
    return json.dumps(body, ensure_ascii=ascii_only).encode()


# --- properties ------------------------------------------------------------------------------


@PROPERTY
@given(body=valid_bodies(), ascii_only=st.booleans())
def test_valid_bodies_with_odd_unicode_are_served(
    fuzz_gateway: FuzzTarget, body: dict[str, Any], ascii_only: bool
) -> None:
    """Any valid body for the in-process mock model, whatever its text and unknown fields, is a
    200 with a whole reply or a complete stream."""
    what = f"valid body {body!r}"
    response = checked(post(fuzz_gateway, encode(body, ascii_only)), what)
    assert_completion(response, bool(body.get("stream")), what)


@settings(PROPERTY, max_examples=25)
@given(body=valid_bodies(models=MODELS[1:]))
def test_valid_bodies_through_the_upstream_adapters(fuzz_gateway: FuzzTarget, body: dict[str, Any]) -> None:
    """The same bodies through the OpenAI adapter (passed through, or re-encoded for a renamed
    model) and the Anthropic translation, to the mock upstream: served alike."""
    what = f"valid body {body!r}"
    response = checked(post(fuzz_gateway, encode(body, ascii_only=False)), what)
    assert_completion(response, bool(body.get("stream")), what)


NESTING_PLACES = ("unknown_field", "content_part", "message_field", "messages")
NESTED_TOO_DEEP = "nested too deeply"


def nested(depth: int, bracket: str) -> bytes:
    if bracket == "[":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


def nested_body(model: str, place: str, inner: bytes) -> bytes:
    start = b'{"model":' + json.dumps(model).encode() + b',"messages":'
    if place == "unknown_field":
        return start + b'[{"role":"user","content":"hi"}],"x":' + inner + b"}"
    if place == "content_part":
        return start + b'[{"role":"user","content":[' + inner + b"]}]}"
    if place == "message_field":
        return start + b'[{"role":"user","content":"hi","x":' + inner + b"}]}"
    return start + inner + b"}"


@PROPERTY
@given(
    depth=st.integers(1, 10_000),
    bracket=st.sampled_from("[{"),
    place=st.sampled_from(NESTING_PLACES),
    model=st.sampled_from(MODELS),
)
@example(depth=10_000, bracket="[", place="unknown_field", model="mock")
@example(depth=10_000, bracket="{", place="content_part", model="mock")
@example(depth=10_000, bracket="[", place="message_field", model="gpt-4o-mini")
@example(depth=10_000, bracket="{", place="messages", model="claude-sonnet")
@example(depth=900, bracket="[", place="content_part", model="claude-sonnet")
@example(depth=900, bracket="[", place="unknown_field", model="renamed")
def test_deep_nesting_is_refused_cleanly(
    fuzz_gateway: FuzzTarget, depth: int, bracket: str, place: str, model: str
) -> None:
    """Nesting a few levels deep is ordinary JSON; thousands of levels are a 400 that says so,
    never a 500, whichever target the model routes to."""
    body = nested_body(model, place, nested(depth, bracket))
    assert len(body) <= BODY_LIMIT
    what = f"{depth} levels of {bracket!r} in {place} for {model}"
    response = checked(post(fuzz_gateway, body), what)
    if place == "messages":
        assert_error(response, 400, "invalid_request", what)  # not a list of message objects
    elif depth >= 2_000:
        error = assert_error(response, 400, "invalid_request", what)
        assert NESTED_TOO_DEEP in error["message"], f"{what}: {error}"
    elif depth <= 100 and model == "mock":
        assert_completion(response, False, what)


LIMIT_WAVERS = 8
"""How far the nesting limit may move between requests: it is the stack left, and what else is
on the stack (a garbage collection's finalizers, say) varies a little."""


@pytest.fixture(scope="module")
def nesting_limit(fuzz_gateway: FuzzTarget) -> int:
    """The deepest nesting the gateway's own check lets through (found by bisection)."""
    accepted, refused = 1, 10_000
    while refused - accepted > 1:
        depth = (accepted + refused) // 2
        response = post(fuzz_gateway, nested_body("mock", "unknown_field", nested(depth, "[")))
        accepted, refused = (depth, refused) if response.status_code == 200 else (accepted, depth)
    return accepted


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["renamed", "claude-sonnet"])
def test_nesting_just_under_the_limit_is_served_by_every_adapter(
    fuzz_gateway: FuzzTarget, nesting_limit: int, model: str, stream: bool
) -> None:
    """Every depth from well under the gateway's limit to over it: served, or a 400 that says why.
    The OpenAI adapter (re-encoding for a renamed model) and the Anthropic translation decode the
    body again, deeper in the stack; bodies just under the gateway's limit used to pass its check
    and overflow there: a 500. (The limit is the stack left, so it wavers by a few levels.)"""
    for depth in range(nesting_limit - 80, nesting_limit + 16):
        body = nested_body(model, "unknown_field", nested(depth, "["))
        if stream:
            body = body[:-1] + b',"stream":true}'
        what = (
            f"{depth} levels (limit about {nesting_limit}) in an unknown field for {model} (stream={stream})"
        )
        response = checked(post(fuzz_gateway, body), what)
        if depth < nesting_limit - LIMIT_WAVERS:
            assert_completion(response, stream, what)
        elif depth > nesting_limit + LIMIT_WAVERS or response.status_code != 200:
            error = assert_error(response, 400, "invalid_request", what)
            assert NESTED_TOO_DEEP in error["message"], f"{what}: {error}"


DEEP_ARGUMENTS = '{"a":' * 5_000 + "1" + "}" * 5_000
"""Tool-call ``arguments`` are JSON inside a JSON string: flat for the body, 5,000 deep inside."""


@pytest.mark.parametrize(
    "model",
    MODELS,
)
def test_deeply_nested_tool_call_arguments(fuzz_gateway: FuzzTarget, model: str) -> None:
    """Passed through, or refused with a 400; never a 500."""
    body = {
        "model": model,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGUMENTS}}
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "done"},
        ],
    }
    what = f"tool-call arguments nested 5,000 deep for {model}"
    response = checked(post(fuzz_gateway, encode(body, ascii_only=True)), what)
    if response.status_code != 200:
        assert_error(response, 400, "invalid_request", what)


OPENAI_REPLY = (
    b'{"id":"c","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
)
ANTHROPIC_REPLY = (
    b'{"id":"m","type":"message","role":"assistant","model":"m","content":[{"type":"text","text":"hi"}],'
    b'"stop_reason":"end_turn","usage":{"input_tokens":1,"output_tokens":1}}'
)


class DeepReplies(BaseHTTPRequestHandler):
    """An upstream whose whole replies are valid but carry a field nested 5,000 deep."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        reply = ANTHROPIC_REPLY if self.path.endswith("/messages") else OPENAI_REPLY
        body = reply[:-1] + b',"extra":' + nested(5_000, "[") + b"}"
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.fixture(scope="module")
def deep_reply_gateway(session_tmp: Path, redis_server: RedisServer) -> Iterator[Gateway]:
    """A gateway like the fuzzed one, whose upstream answers with :class:`DeepReplies`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), DeepReplies)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    upstream_url = f"http://127.0.0.1:{server.server_port}"
    process = Gateway(
        session_tmp, fuzz_config(upstream_url, redis_server.url, f"fuzz-{uuid.uuid4().hex[:10]}")
    )
    try:
        yield process.start()
    finally:
        process.stop()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize("model", ["gpt-4o-mini", "claude-sonnet"])
def test_deeply_nested_upstream_replies_are_502(deep_reply_gateway: Gateway, model: str) -> None:
    """An upstream reply the gateway cannot use is a 502 ``upstream_error`` (SPEC.md), whatever
    makes it unusable."""
    response = httpx.post(
        f"{deep_reply_gateway.url}/v1/chat/completions",
        content=encode({"model": model, "messages": [{"role": "user", "content": "hi"}]}, True),
        headers=AUTH,
        timeout=15,
    )
    what = f"a reply nested 5,000 deep from {model}'s upstream"
    assert_error(checked(response, what), 502, "upstream_error", what)


@settings(PROPERTY, max_examples=30)
@given(
    size=st.integers(BODY_LIMIT - 512, BODY_LIMIT + 512),
    char=st.sampled_from(["x", "\u00e9", "\U0001f600", "\x00", "\u202e"]),
    ascii_only=st.booleans(),
    chunked=st.booleans(),
)
@example(size=BODY_LIMIT, char="x", ascii_only=True, chunked=False)
@example(size=BODY_LIMIT + 1, char="x", ascii_only=True, chunked=False)
@example(size=BODY_LIMIT + 1, char="x", ascii_only=True, chunked=True)
def test_huge_strings_up_to_the_limit_pass_and_over_it_are_413(
    fuzz_gateway: FuzzTarget, size: int, char: str, ascii_only: bool, chunked: bool
) -> None:
    """A body of at most ``max_body_bytes`` is served, one byte more is 413 ``request_too_large``,
    with or without a ``Content-Length``."""
    body = fit(size, char, ascii_only)
    what = f"{len(body)}-byte body of {char!r} (limit {BODY_LIMIT}, chunked={chunked})"
    content: bytes | Iterator[bytes] = (
        iter([body[: len(body) // 2], body[len(body) // 2 :]]) if chunked else body
    )
    response = checked(post(fuzz_gateway, content), what)
    if len(body) > BODY_LIMIT:
        assert_error(response, 413, "request_too_large", what)
    else:
        assert_completion(response, False, what)


def fit(size: int, char: str, ascii_only: bool) -> bytes:
    """A valid body of about ``size`` bytes (exactly, for single-byte characters) of ``char``."""

    def body(count: int) -> bytes:
        return encode({"model": "mock", "messages": [{"role": "user", "content": char * count}]}, ascii_only)

    per_char = len(body(1)) - len(body(0))
    count = max(0, (size - len(body(0))) // per_char)
    return body(count) + b" " * max(0, size - len(body(count)))


WRONG_TYPES: dict[str, st.SearchStrategy[Any]] = {
    "model": st.one_of(
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.booleans(),
        st.none(),
        st.lists(odd_text, max_size=2),
    ),
    "messages": st.one_of(
        odd_text, st.integers(), st.booleans(), st.none(), st.dictionaries(odd_text, odd_text)
    ),
    "messages[0]": st.one_of(
        odd_text, st.integers(), st.booleans(), st.none(), st.lists(odd_text, max_size=2)
    ),
    "messages[0].role": st.one_of(st.integers(), st.booleans(), st.none(), st.lists(odd_text, max_size=2)),
    "messages[0].content": st.one_of(
        st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.just({})
    ),
    "stream": st.one_of(
        odd_text,
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.lists(st.booleans(), max_size=2),
    ),
    "max_tokens": st.one_of(
        odd_text,
        st.booleans(),
        st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
        st.just([]),
    ),
    "max_completion_tokens": st.one_of(odd_text, st.booleans(), st.just({"n": 1})),
    "stream_options": st.one_of(odd_text, st.integers(), st.booleans(), st.lists(st.booleans(), max_size=2)),
    "stream_options.include_usage": st.one_of(odd_text, st.integers(), st.none(), st.just({})),
}
"""For each field the gateway reads (README "Requests"), values it must refuse."""
MISSING = ["model", "messages", "messages[0].role"]


def place_value(body: dict[str, Any], path: str, value: Any) -> None:
    """Set (or, for ``...``, delete) ``path`` (``a``, ``a[0]``, ``a[0].b``, ``a.b``) in ``body``."""
    parts = path.replace("[0]", ".0").split(".")
    parent: Any = body
    for part in parts[:-1]:
        parent = parent[int(part)] if part.isdigit() else parent.setdefault(part, {})
    last: Any = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    if value is ...:
        del parent[last]
    else:
        parent[last] = value


@settings(PROPERTY, max_examples=60)
@given(field=st.sampled_from(sorted(WRONG_TYPES)), data=st.data(), ascii_only=st.booleans())
def test_wrong_types_are_400_naming_the_field(
    fuzz_gateway: FuzzTarget, field: str, data: st.DataObject, ascii_only: bool
) -> None:
    value = data.draw(WRONG_TYPES[field], label="value")
    body: dict[str, Any] = {"model": "mock", "messages": [{"role": "user", "content": "hi"}]}
    place_value(body, field, value)
    what = f"{field} = {value!r}"
    error = assert_error(
        checked(post(fuzz_gateway, encode(body, ascii_only)), what), 400, "invalid_request", what
    )
    assert error["param"] == field, f"{what}: {error}"
    assert "expected" in error["message"], f"{what}: {error}"


@pytest.mark.parametrize("field", MISSING)
def test_missing_fields_are_400_naming_the_field(fuzz_gateway: FuzzTarget, field: str) -> None:
    body: dict[str, Any] = {"model": "mock", "messages": [{"role": "user", "content": "hi"}]}
    place_value(body, field, ...)
    error = assert_error(
        checked(post(fuzz_gateway, encode(body, True)), field), 400, "invalid_request", field
    )
    assert error["param"] == field
    assert "missing required field" in error["message"]


RIGHT_TYPE: dict[str, Callable[[Any], bool]] = {
    "model": lambda value: isinstance(value, str),
    "messages": lambda value: value == [],
    "stream": lambda value: value is None or isinstance(value, bool),
    "max_tokens": lambda value: value is None or (isinstance(value, int) and not isinstance(value, bool)),
}


@settings(PROPERTY, max_examples=30)
@given(
    firsts=st.lists(
        st.tuples(
            st.sampled_from(sorted(RIGHT_TYPE)),
            st.sampled_from(["mock", "no-such-model", 5, None, True, [], "gpt-4o-mini"]),
        ),
        min_size=1,
        max_size=4,
    ),
    stream=st.booleans(),
)
@example(firsts=[("model", "no-such-model")], stream=False)
@example(firsts=[("model", 5)], stream=False)
def test_duplicate_keys_mean_the_last_one(
    fuzz_gateway: FuzzTarget, firsts: list[tuple[str, Any]], stream: bool
) -> None:
    """``{"model": "a", "model": "b"}`` is read as ``{"model": "b"}``, as Python's json and the
    OpenAI-type upstreams read it; but every occurrence must have the field's type: an earlier one
    of the wrong type is a 400 naming the field, though a last-wins reader would not see it."""
    lasts = [
        ("model", '"mock"'),
        ("messages", '[{"role":"user","content":"hi","content":"x"}]'),
        ("stream", json.dumps(stream)),
        ("max_tokens", "8"),
    ]
    pairs = [(key, json.dumps(value)) for key, value in firsts] + lasts
    raw = "{" + ",".join(f"{json.dumps(key)}:{value}" for key, value in pairs) + "}"
    what = f"duplicate keys {raw}"
    response = checked(post(fuzz_gateway, raw.encode()), what)
    wrong = [key for key, value in firsts if not RIGHT_TYPE[key](value)]
    if wrong:
        assert assert_error(response, 400, "invalid_request", what)["param"] == wrong[0]
        return
    assert_completion(response, stream, what)
    overridden = raw[:-1] + ',"model":"no-such-model"}'
    assert_error(checked(post(fuzz_gateway, overridden.encode()), what), 404, "model_not_found", what)


@settings(PROPERTY, max_examples=40)
@given(body=valid_bodies(), cut=st.integers(0, 10**6))
@example(body={"model": "mock", "messages": [{"role": "user", "content": "hi"}]}, cut=0)
def test_truncated_json_is_400(fuzz_gateway: FuzzTarget, body: dict[str, Any], cut: int) -> None:
    """Every proper prefix of a body (the empty one included) is invalid JSON: a 400."""
    raw = encode(body, ascii_only=False)
    cut %= len(raw)
    what = f"{raw[:cut]!r}"
    error = assert_error(checked(post(fuzz_gateway, raw[:cut]), what), 400, "invalid_request", what)
    assert error["message"] == "the request body is not valid JSON", what


INVALID_UTF8 = [
    b"\xff",
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xc0\xaf",
    b"\xf8\x88\x80\x80\x80",
    b"\xe2\x82",
    b"\x80",
]
LONE_SURROGATES = [b"\\ud800", b"\\udfff", b"\\ud83d", b"\\ude00\\ud83d"]


@settings(PROPERTY, max_examples=40)
@given(
    where=st.sampled_from(["model", "role", "content", "unknown_field", "content_part"]),
    bad=st.sampled_from(INVALID_UTF8 + LONE_SURROGATES),
    model=st.sampled_from(MODELS),
)
def test_bytes_that_are_not_utf8_or_lone_surrogates(
    fuzz_gateway: FuzzTarget, where: str, bad: bytes, model: str
) -> None:
    """In a field the gateway reads: a 400. In one it passes through (an unknown field, a content
    part) the upstream may judge it, but never a 500."""
    strings = {"model": model, "role": "user", "content": "hi", "unknown_field": "x", "content_part": "y"}
    pieces = {name: json.dumps(value).encode() for name, value in strings.items()}
    pieces[where] = pieces[where][:-1] + bad + b'"'
    raw = (
        b'{"model":'
        + pieces["model"]
        + b',"messages":[{"role":'
        + pieces["role"]
        + b',"content":'
        + pieces["content"]
        + b'},{"role":"user","content":[{"type":"text","text":'
        + pieces["content_part"]
        + b'}]}],"x":'
        + pieces["unknown_field"]
        + b"}"
    )
    what = f"{bad!r} in {where} for {model}"
    response = checked(post(fuzz_gateway, raw), what)
    if where in ("model", "role", "content") or bad in LONE_SURROGATES:
        error = assert_error(response, 400, "invalid_request", what)
        assert error["message"] == "the request body is not valid JSON", what


@settings(PROPERTY, max_examples=30)
@given(raw=st.binary(max_size=300))
@example(raw=b"")
@example(raw=b"null")
@example(raw=b"[]")
@example(raw=b'"a string"')
@example(raw=b"{}")
@example(raw=b"\xef\xbb\xbf{}")
def test_random_bytes_are_400(fuzz_gateway: FuzzTarget, raw: bytes) -> None:
    assert_error(checked(post(fuzz_gateway, raw), f"{raw!r}"), 400, "invalid_request", f"{raw!r}")


CONTENT_TYPES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "application/xml",
    "",
    "*/*",
]


@settings(PROPERTY, max_examples=20)
@given(content_type=st.sampled_from(CONTENT_TYPES), valid=st.booleans())
def test_any_content_type_is_read_as_json(fuzz_gateway: FuzzTarget, content_type: str, valid: bool) -> None:
    """The gateway reads the body as JSON whatever the ``Content-Type`` says (lenient, like the
    OpenAI API): a valid body is served, an invalid one is a 400."""
    body = encode({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}, True)
    raw = body if valid else b"model=mock&messages=hi"
    what = f"{raw!r} as {content_type!r}"
    response = checked(post(fuzz_gateway, raw, {"content-type": content_type}), what)
    if valid:
        assert_completion(response, False, what)
    else:
        assert_error(response, 400, "invalid_request", what)


header_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=140
)
"""What HTTP lets a header value be: visible ASCII, space and obs-text (stripped where used, as
HTTP strips the ends of a value)."""


@settings(PROPERTY, max_examples=40)
@given(task_id=header_values.map(str.strip), request_id=header_values.map(str.strip))
@example(task_id="x" * 128, request_id="y" * 128)
@example(task_id="x" * 129, request_id="y" * 129)
@example(task_id="caf\u00e9", request_id="caf\u00e9")
def test_task_and_request_ids(fuzz_gateway: FuzzTarget, task_id: str, request_id: str) -> None:
    """``X-Task-Id`` outside ``[A-Za-z0-9._:-]{1,128}`` is a 400 naming it; ``X-Request-Id`` is
    echoed only when sane, else replaced by a fresh id."""
    headers = [
        (b"authorization", AUTH["authorization"].encode()),
        (b"x-task-id", task_id.encode("latin-1")),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    what = f"X-Task-Id {task_id!r}, X-Request-Id {request_id!r}"
    response = checked(
        fuzz_gateway.client.post(
            "/v1/chat/completions",
            content=encode({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}, True),
            headers=headers,
        ),
        what,
    )
    if TASK_ID.fullmatch(task_id):
        assert_completion(response, False, what)
    else:
        assert assert_error(response, 400, "invalid_request", what)["param"] == "X-Task-Id"
    echoed = response.headers["x-request-id"]
    if TASK_ID.fullmatch(request_id):
        assert echoed == request_id, what
    else:
        assert TASK_ID.fullmatch(echoed), what


@settings(PROPERTY, max_examples=30)
@given(host=header_values.map(str.strip))
@example(host="a b")
@example(host="[zz")
@example(host="")
@example(host="127.0.0.1:8080")
def test_odd_host_headers(fuzz_gateway: FuzzTarget, host: str) -> None:
    """Litestar refuses a ``Host`` it cannot parse before any route runs; that refusal is a 400 in
    the OpenAI shape (it was a 500 ``internal_error``)."""
    what = f"Host {host!r}"
    response = checked(
        fuzz_gateway.client.post(
            "/v1/chat/completions",
            content=encode({"model": "mock", "messages": [{"role": "user", "content": "hi"}]}, True),
            headers=[(b"authorization", AUTH["authorization"].encode()), (b"host", host.encode("latin-1"))],
        ),
        what,
    )
    if response.status_code != 200:
        assert_error(response, 400, "invalid_request", what)
