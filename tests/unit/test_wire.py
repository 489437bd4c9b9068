"""Jupyter's websocket formats, byte for byte against jupyter_server's own code."""

import json

import pytest
from jupyter_server.services.kernels.connection import base as js

from sandgate.api import wire

MSG = {"header": {"msg_id": "1", "msg_type": "execute_request", "session": "s"}, "parent_header": {},
       "metadata": {}, "content": {"code": "1+1"}}


def parts(buffers=()):
    return [json.dumps(MSG[k]).encode() for k in ("header", "parent_header", "metadata", "content")] + list(buffers)


def test_v1_matches_jupyter_server():
    p = parts([b"\x00buf"])
    ours = wire.encode_v1("shell", p)
    assert ours == js.serialize_msg_to_ws_v1(p, "shell")
    channel, back, header = wire.decode_v1(ours)
    assert channel == "shell" and back == p and header["msg_type"] == "execute_request"
    assert js.deserialize_msg_from_ws_v1(ours) == ("shell", p)


def test_legacy_with_buffers_matches_jupyter_server():
    encoded = wire.encode_legacy("shell", parts([b"\x01\x02"]))
    assert isinstance(encoded, bytes)
    msg = js.deserialize_binary_message(encoded)
    assert msg["content"] == MSG["content"] and msg["buffers"][0] == b"\x01\x02" and msg["channel"] == "shell"
    theirs = js.serialize_binary_message({**MSG, "channel": "shell", "buffers": [b"\x03"]})
    channel, back, _ = wire.decode_legacy(theirs)
    assert channel == "shell" and back[4] == b"\x03" and json.loads(back[3]) == MSG["content"]


def test_legacy_text():
    text = wire.encode_legacy("iopub", parts())
    assert json.loads(text)["channel"] == "iopub" and json.loads(text)["msg_type"] == "execute_request"
    channel, back, _ = wire.decode_legacy(json.dumps({**MSG, "channel": "control"}))
    assert channel == "control" and json.loads(back[0]) == MSG["header"]


@pytest.mark.parametrize("frame, why", [
    ("nope", "not a JSON"), ("[]", "JSON object"), (json.dumps({"channel": "iopub", **MSG}), "no such channel"),
    (json.dumps({"header": {}}), "msg_id and msg_type"), (b"\xff\xff\xff\xff", "not a JSON"),
])
def test_legacy_garbage(frame, why):
    with pytest.raises(wire.WireError, match=why):
        wire.decode_legacy(frame)


@pytest.mark.parametrize("frame", [b"", b"\x01" * 7, (99).to_bytes(8, "little") + b"x" * 16, "text"])
def test_v1_garbage(frame):
    with pytest.raises(wire.WireError):
        wire.decode_v1(frame)
