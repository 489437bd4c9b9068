"""The kernel websocket's protocol on the in-process gateway: both wire formats, bad frames, the
frame bound, and the upgrade's statuses. What a real kernel does over it is tests/test_channels.py."""

import json
import uuid

import pytest
import websocket


@pytest.mark.parametrize("v1", [False, True], ids=["legacy", "v1"])
def test_execute_both_protocols(gateway, kernel, v1):
    c = gateway.connect(kernel, v1=v1)
    if v1:
        assert c.ws.subprotocol == "v1.kernel.websocket.jupyter.org"
    out = c.execute("1+1")
    assert out["results"] == [{"text/plain": "2"}]
    assert out["reply"]["status"] == "ok"
    kinds = [m["msg_type"] for m in out["msgs"]]
    assert kinds[0] == "status" and "execute_input" in kinds and "execute_reply" in kinds
    c.close()


def test_garbage_frames_are_ignored(gateway, kernel):
    c = gateway.connect(kernel)  # bad frames go through c.ws, the raw socket: the SDK cannot send them
    c.ws.send("not json")
    c.ws.send(json.dumps({"foo": 1}))
    c.ws.send(json.dumps({"channel": "nochan", "header": {"msg_id": "1", "msg_type": "x"}, "content": {}}))
    c.ws.send_binary(b"\x00\x01garbage")
    # The same connection still works, and the gateway said why it ignored them.
    assert c.execute("3*3")["results"][0]["text/plain"] == "9"
    log = gateway.log_text()
    assert "ignoring a bad websocket frame: not a JSON Jupyter message" in log
    assert "no such channel: 'nochan'" in log
    c.close()
    # A v1 client sending text is told off the same way.
    v = gateway.connect(kernel, v1=True)
    v.ws.send("text frame")
    assert v.execute("4*4")["results"][0]["text/plain"] == "16"
    assert "the v1 protocol carries binary frames only" in gateway.log_text()
    v.close()


def test_oversized_message_closes_that_socket_only(gateway, kernel):
    c = gateway.connect(kernel)  # the raw socket (c.ws): the frame and the close code are the test
    try:
        c.ws.send("x" * (65 << 20))  # over the 64 MB bound
    except (BrokenPipeError, ConnectionResetError, websocket.WebSocketConnectionClosedException):
        pass  # the gateway may close before the whole frame is written
    else:
        opcode, data = c.ws.recv_data(control_frame=True)
        while opcode != websocket.ABNF.OPCODE_CLOSE:
            opcode, data = c.ws.recv_data(control_frame=True)
        assert int.from_bytes(data[:2], "big") == 1009  # "message too big"
    fresh = gateway.connect(kernel)
    assert fresh.execute("'fine'")["results"][0]["text/plain"] == "'fine'"
    fresh.close()


def test_websocket_errors(gateway, kernel):
    """Raw websocket-client on purpose: the HTTP statuses of the upgrade are what is tested."""
    with pytest.raises(websocket.WebSocketBadStatusException) as e:
        websocket.create_connection(f"ws://127.0.0.1:{gateway.port}/api/kernels/{uuid.uuid4()}/channels?token={gateway.token}")
    assert e.value.status_code == 404
    with pytest.raises(websocket.WebSocketBadStatusException) as e:
        websocket.create_connection(f"ws://127.0.0.1:{gateway.port}/api/kernels/{kernel}/channels")
    assert e.value.status_code == 401
    ws = websocket.create_connection(f"ws://127.0.0.1:{gateway.port}/api/kernels/{kernel}/channels?token={gateway.token}")
    assert gateway.request("GET", f"/api/kernels/{kernel}").json()["connections"] >= 1
    ws.close()
