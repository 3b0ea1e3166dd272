"""A manifest's JSON as the docs/spec/decoding-rules.md receiver rule 2 reads it, and how
tensor-set messages
quote names and values, against both set layers (the native session's and the
reference's): the depth scan, RFC 8259 strictness with one message and no position, the
4300-digit limit, lone surrogates, when a repeated key is found, and compact ASCII JSON
quoting. None of it may depend on Python's own wording, so a Rust reader can match it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import pytest

from gradstream.errors import TensorSetError
from gradstream.reference._manifest import Entry
from support.frames import HEADER, HEADER_LEN
from support.tensor_sets import (
    assert_error,
    manifest_codecs,
    outcome,
    raw,
    receive_bytes,
    run,
    session,
)

NOT_JSON = "tensor set manifest is not valid JSON"
TOO_DEEP = "tensor set manifest nests arrays or objects deeper than 32 levels"
HEAD = '{"format":"gradstream.tensors","version":1,"tensors":'
NOT_OBJECT = "tensor set manifest is a JSON array, not an object"


def one(name: str = '"w"', dtype: str = '"float32"', shape: str = "[2]") -> str:
    """A manifest of one entry, its parts given as JSON text."""
    return f'{HEAD}[{{"name":{name},"dtype":{dtype},"shape":{shape}}}]}}'


def refused(parse: Any, text: str) -> TensorSetError:
    with pytest.raises(TensorSetError) as info:
        parse(text)
    return info.value


def manifest_end(wire: bytes) -> int:
    """Where the manifest frame at the start of a set's bytes ends."""
    return HEADER_LEN + HEADER.unpack_from(wire)[2]


def dtype_error(name: str, dtype: str) -> str:
    return f"tensor {name}: dtype {dtype} is not float16, bfloat16, float32 or float64"


# --------------------------------------------------------------------------- the depth scan


@pytest.mark.parametrize("codec", manifest_codecs())
def test_the_depth_scan_allows_32_levels_and_refuses_33(codec: Any) -> None:
    _, parse = codec
    assert str(refused(parse, "[" * 32 + "]" * 32)) == NOT_OBJECT
    assert str(refused(parse, "[" * 33 + "]" * 33)) == TOO_DEEP
    # Objects count as arrays do; the scan comes before the parse, so even text that is
    # not JSON (unclosed, mismatched) is refused for its depth.
    nested = '{"a":' * 33 + "1" + "}" * 33
    assert str(refused(parse, nested)) == TOO_DEEP
    assert str(refused(parse, '{"a":' * 32 + "1" + "}" * 32)) == "tensor set manifest has no " + (
        '"format" key'
    )
    assert str(refused(parse, "[{" * 17)) == TOO_DEEP
    assert str(refused(parse, "[{" * 16 + "x")) == NOT_JSON
    # Closing brackets give the depth back: 33 arrays one after another are fine; stray
    # ones take it below zero.
    assert str(refused(parse, "[" + "[]," * 33 + "[]]")) == NOT_OBJECT
    assert str(refused(parse, "]]" + "[" * 33 + "]" * 33)) == NOT_JSON
    assert str(refused(parse, "]]" + "[" * 35 + "]" * 35)) == TOO_DEEP
    # The depth in a valid manifest: the entries' shapes sit at level 3.
    deep_value = "[" * 29 + "]" * 29  # at level 3 (top object, dtype's entry): 32 in all
    assert str(refused(parse, one(dtype=deep_value))).startswith('tensor "w": dtype [[[[')
    assert str(refused(parse, one(dtype="[" + deep_value + "]"))) == TOO_DEEP


@pytest.mark.parametrize("codec", manifest_codecs())
def test_brackets_inside_strings_do_not_count(codec: Any) -> None:
    _, parse = codec
    deep_name = '"' + "[{" * 40 + '"'
    assert parse(one(name=deep_name)) == [Entry("[{" * 40, "float32", (2,))]
    # An escaped quote does not end the string; an escaped backslash does not escape the
    # quote after it.
    assert str(refused(parse, '["\\"' + "[" * 40 + '"]')) == NOT_OBJECT
    assert str(refused(parse, '["\\\\"' + "[" * 40 + "]" * 40 + "]")) == TOO_DEEP
    # A string left open runs to the end of the text: nothing after it counts.
    assert str(refused(parse, '["' + "[" * 40)) == NOT_JSON
    assert str(refused(parse, '["\\' + "\\" * 3 + "[" * 40)) == NOT_JSON
    assert str(refused(parse, '["abc\\')) == NOT_JSON
    # A backslash outside a string skips nothing.
    assert str(refused(parse, "\\" + "[" * 33)) == TOO_DEEP


# --------------------------------------------------------------------------- strict JSON


NOT_RFC_8259 = [
    "",
    " ",
    "{",
    "nul",
    "TRUE",
    "\ufeff{}",  # a byte order mark
    "{}\f",  # form feed is not JSON whitespace
    "{} x",
    "{}{}",
    "[1,]",
    '{"a":1,}',
    "{'a':1}",
    '{"a" 1}',
    "[01]",
    "[1.]",
    "[.5]",
    "[+1]",
    "[-]",
    "[1e]",
    "[1e+]",
    "[0x10]",
    "[NaN]",
    "[Infinity]",
    "[-Infinity]",
    '["a\tb"]',  # a raw control character in a string
    '["a\x00"]',
    '["\\x41"]',
    '["\\u12"]',
    '["\\u12g4"]',
    '["\\U0041"]',
    '["\\\'"]',
    '["abc]',
]


@pytest.mark.parametrize("codec", manifest_codecs())
@pytest.mark.parametrize("text", NOT_RFC_8259)
def test_text_that_is_not_json_gets_one_message(codec: Any, text: str) -> None:
    _, parse = codec
    error = refused(parse, text)
    assert (str(error), error.name) == (NOT_JSON, None)


@pytest.mark.parametrize("codec", manifest_codecs())
def test_json_whitespace_and_escapes_are_read(codec: Any) -> None:
    _, parse = codec
    text = (
        ' \t\n\r{"format" : "gradstream.tensors",\n"version":1 ,"tensors":[{"name":'
        '"\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\uD83D\\uDE00\x7f","dtype":"float16","shape":[]}]}\r\n'
    )
    assert parse(text) == [Entry('"\\/\b\f\n\r\té\U0001f600\x7f', "float16", ())]


@pytest.mark.parametrize("codec", manifest_codecs())
def test_integer_literals_of_more_than_4300_digits_are_not_json(codec: Any) -> None:
    _, parse = codec
    version = "tensor set manifest version {} is not supported (this gradstream reads version 1)"
    for digits in ("1" * 4300, "-" + "1" * 4300):
        text = '{"format":"gradstream.tensors","version":' + digits + ',"tensors":[]}'
        assert str(refused(parse, text)) == version.format(digits[:77] + "...")
    for digits in ("1" * 4301, "-" + "1" * 4301):
        text = '{"format":"gradstream.tensors","version":' + digits + ',"tensors":[]}'
        assert str(refused(parse, text)) == NOT_JSON
    # Whatever this interpreter's own limit.
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        assert str(refused(parse, "[" + "7" * 5000 + "]")) == NOT_JSON
    finally:
        sys.set_int_max_str_digits(old)
    # A float literal has no such limit; -0 is the integer 0.
    long_float = "1." + "0" * 5000
    text = '{"format":"gradstream.tensors","version":' + long_float + ',"tensors":[]}'
    assert str(refused(parse, text)) == version.format("1.0")
    text = '{"format":"gradstream.tensors","version":-0,"tensors":[]}'
    assert str(refused(parse, text)) == version.format("0")


# --------------------------------------------------------------------------- lone surrogates


@pytest.mark.parametrize("codec", manifest_codecs())
def test_lone_surrogate_escapes_are_not_json(codec: Any) -> None:
    _, parse = codec
    for text in (
        one(name='"\\ud800"'),
        one(name='"a\\udc00"'),
        one(name='"\\ud83d\\u0041"'),  # a high surrogate, then no low one
        one(name='"\\ude00\\ud83d"'),  # the pair in the wrong order
        one(dtype='"\\udfff"'),
        HEAD + '[],"x":{"\\ud800":1}}',  # in a key, of an object nobody reads
        "[" + '"ok",' * 3 + '"\\ud800"]',
    ):
        error = refused(parse, text)
        assert (str(error), error.name) == (NOT_JSON, None), text
    # Only after the whole parse: a repeated key found earlier, in a closed object, is
    # reported first; a syntax error anywhere is not JSON as well.
    text = '[{"\\ud800":1,"\\ud800":2}, "\\udc00"]'
    assert (
        str(refused(parse, text))
        == 'tensor set manifest repeats the key "\\ud800" in one JSON object'
    )
    assert str(refused(parse, '["\\ud800", {"k":1,"k":2}]')) == (
        'tensor set manifest repeats the key "k" in one JSON object'
    )
    # Two different lone surrogates are two different keys.
    assert str(refused(parse, '{"\\ud800":1,"\\udc00":2}')) == NOT_JSON
    # A well-formed pair is one character.
    assert parse(one(name='"\\ud83d\\ude00"', shape="[]")) == [Entry("\U0001f600", "float32", ())]


# --------------------------------------------------------------------------- repeated keys


@pytest.mark.parametrize("codec", manifest_codecs())
def test_a_repeated_key_is_found_when_its_object_closes(codec: Any) -> None:
    _, parse = codec
    repeats = 'tensor set manifest repeats the key "{}" in one JSON object'.format
    cases = [
        # A closed object's duplicate comes before a syntax error later in the text ...
        ('[{"a":1,"a":2}] x', repeats("a")),
        ('[{"a":1,"a":2}, nope]', repeats("a")),
        # ... but an object not yet closed cannot report it.
        ('[{"a":1,"a":2 x', NOT_JSON),
        ('{"a":1,"a":2,}', NOT_JSON),
        # Inner objects close first.
        ('{"a":{"b":1,"b":2},"a":3}', repeats("b")),
        # The first key, in order, that repeats an earlier one.
        ('{"x":1,"y":2,"y":3,"x":4}', repeats("y")),
        ('{"x":1,"y":2,"x":3,"y":4}', repeats("x")),
        # Keys compare as text: an escape and the character it stands for are one key.
        ('{"\\u00e9":1,"é":2}', repeats("\\u00e9")),
        # Distinct keys: the object is read (and then fails the schema).
        ('{"a":1,"A":2,"a\\u0000":3}', 'tensor set manifest has no "format" key'),
    ]
    for text, message in cases:
        assert str(refused(parse, text)) == message, text
    # The depth scan comes before everything.
    assert str(refused(parse, '{"a":1,"a":2,"b":' + "[" * 40)) == TOO_DEEP


# --------------------------------------------------------------------------- quoting


@pytest.mark.parametrize("codec", manifest_codecs())
def test_names_and_values_are_quoted_as_compact_ascii_json(codec: Any) -> None:
    _, parse = codec
    cases = [
        # (name JSON text, dtype JSON text, the message's quotes of name and dtype)
        ('"é€😀"', '"int8"', '"\\u00e9\\u20ac\\ud83d\\ude00"', '"int8"'),
        ('"a\\u0001\\u001f\\u007f\\n"', "1", '"a\\u0001\\u001f\\u007f\\n"', "1"),
        ('"q\\"\\\\/"', "true", '"q\\"\\\\/"', "true"),
        ('"w"', "null", '"w"', "null"),
        ('"w"', "1.0", '"w"', "1.0"),
        ('"w"', "1E16", '"w"', "1e+16"),
        ('"w"', "1e15", '"w"', "1000000000000000.0"),
        ('"w"', "0.0001", '"w"', "0.0001"),
        ('"w"', "0.000015", '"w"', "1.5e-05"),
        ('"w"', "-0.0", '"w"', "-0.0"),
        ('"w"', "-0", '"w"', "0"),
        ('"w"', "1e400", '"w"', "Infinity"),
        ('"w"', "-1e400", '"w"', "-Infinity"),
        ('"w"', "1e-400", '"w"', "0.0"),
        ('"w"', "0.1", '"w"', "0.1"),
        ('"w"', "123456789012345678901234567890", '"w"', "123456789012345678901234567890"),
        ('"w"', "2.5e-320", '"w"', "2.5e-320"),
        ('"w"', ' [ 1 , {"b" : [ ] , "a":"\\u00e9"} ] ', '"w"', '[1,{"b":[],"a":"\\u00e9"}]'),
    ]
    for name, dtype, name_quote, dtype_quote in cases:
        error = refused(parse, one(name=name, dtype=dtype))
        assert str(error) == dtype_error(name_quote, dtype_quote), (name, dtype)
        assert error.name == json.loads(name)


@pytest.mark.parametrize("codec", manifest_codecs())
def test_a_quote_is_cut_to_80_characters(codec: Any) -> None:
    _, parse = codec
    fits = '"' + "d" * 78 + '"'  # 80 characters with its quotes
    assert str(refused(parse, one(dtype=fits))) == dtype_error('"w"', fits)
    over = '"' + "d" * 79 + '"'
    assert str(refused(parse, one(dtype=over))) == dtype_error('"w"', over[:77] + "...")
    # ASCII JSON is cut, not the text: an escape may be cut in the middle.
    escaped = '"' + "é" * 20 + '"'
    assert str(refused(parse, one(dtype=escaped))) == dtype_error(
        '"w"', ('"' + "\\u00e9" * 20)[:77] + "..."
    )
    # Names are quoted the same way wherever they stand.
    long_name = "n" * 100
    error = refused(parse, one(name=json.dumps(long_name), dtype='"int8"'))
    assert str(error) == dtype_error('"' + "n" * 76 + "...", '"int8"')
    assert error.name == long_name


def test_notes_and_arrival_errors_quote_names_as_json(impl: Any) -> None:
    s = session(impl)
    name = "couche.é😀"
    quoted = '"couche.\\u00e9\\ud83d\\ude00"'
    # The float32 set's manifest, then the frames of the float16 set's tensor.
    good = s.encode_tensors({name: np.zeros(3, np.float32)})
    bad = s.encode_tensors({name: np.zeros(3, np.float16)})
    data = good[: manifest_end(good)] + bad[manifest_end(bad) :]
    note = f"while receiving tensor {quoted} (1 of 1) of a tensor set"
    text = f"tensor {quoted} arrived as float16 [3]; the manifest says float32 [3]"
    found = [outcome(lambda: s.decode_tensors(data))]
    for path in ("socket", "streams"):
        found.append(run(lambda path=path: receive_bytes(s, data, path)))
    assert len(found) == 3
    for got in found:
        assert_error(got, TensorSetError, text, name=name, notes=[note])
    # The sender's notes and messages quote the same way.
    with pytest.raises(TypeError) as info:
        s.encode_tensors({"ok": raw((2,), "float32", 0), name: np.zeros(2, np.int32)})
    assert info.value.__notes__ == [f"while encoding tensor {quoted} (2 of 2) of a tensor set"]
    with pytest.raises(TensorSetError) as twice:
        s.encode_tensors([(name, np.zeros(1)), (name, np.zeros(1))])
    assert str(twice.value) == f"tensor name {quoted} appears twice in the tensor set"
    with pytest.raises(TensorSetError) as lone:
        s.encode_tensors({"\ud800": np.zeros(1)})
    assert str(lone.value) == (
        'tensor name "\\ud800" is not valid Unicode text (a lone surrogate): it has no UTF-8 form'
    )
