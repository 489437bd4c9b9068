"""One open /dev/net/tun makes this runsc panic at the next checkpoint, and the
sandbox would be reported as "exited with status 0". Devices the sandbox does
not need are hidden; a checkpoint still works."""

from __future__ import annotations

from sandgate.drivers.gvisor import runsc_error


def test_tun_is_hidden_and_checkpoints_go_on(gateway):
    sid = gateway.request("POST", "/api/sandboxes", {}).json()["id"]
    try:
        r = gateway.request("POST", f"/api/sandboxes/{sid}/execute", {"code": (
            "import os\ntry:\n    f = open('/dev/net/tun', 'rb'); print('opened')\n"
            "except OSError as e:\n    print('refused', e.errno)\nprint(os.listdir('/dev/net'))")})
        assert r.json()["stdout"] == "refused 2\n[]\n", r.body
        cp = gateway.request("POST", f"/api/sandboxes/{sid}/checkpoints", {})
        assert cp.status == 201, cp.body
        assert gateway.request("GET", f"/api/sandboxes/{sid}").json()["state"] == "running"
    finally:
        gateway.request("DELETE", f"/api/sandboxes/{sid}")


def test_a_runsc_failure_reports_its_cause_not_a_stack_tail():
    out = ("W1203 checkpoint.go:12] something\npanic: unable to save state: tun device cannot be saved\n\n"
           "goroutine 1 [running]:\ngvisor.dev/gvisor/pkg/urpc.(*Server).handleOne(0xc0000b0820)\n\turpc.go:338 +0x4bd\n")
    assert runsc_error(out) == "panic: unable to save state: tun device cannot be saved"
    assert runsc_error("") == "no output"
