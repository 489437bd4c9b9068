"""What reaches a real sandbox's environment from a kernel start: only KERNEL_* variables, never
the gateway's own."""


def test_env_passes_only_kernel_vars(gateway):
    kid = gateway.start_kernel(env={"KERNEL_FOO": "bar", "OTHER": "no", "PATH": "/evil"})
    try:
        c = gateway.connect(kid)
        out = c.execute("import os, json; print(json.dumps(dict(os.environ)))")
        env = __import__("json").loads(out["stdout"])
        assert env["KERNEL_FOO"] == "bar"
        assert "OTHER" not in env and env["PATH"] != "/evil"
        assert "SANDGATE_TOKEN" not in env and gateway.token not in out["stdout"]
        assert not [k for k in env if k.startswith("SANDGATE_")]
        c.close()
    finally:
        gateway.request("DELETE", f"/api/kernels/{kid}")
