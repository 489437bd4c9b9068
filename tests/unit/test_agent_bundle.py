"""The agent bundle (images/rootfs.py's ``agent_bundle``) is what gVisor mounts at
/opt/sandgate and what a VM's agent disk is made of: every module of the guest
agent must be in it, and the agent must import from it alone."""

import subprocess
import sys
from pathlib import Path

import sandgate_agent
from sandgate_images import rootfs

SOURCES = Path(sandgate_agent.__file__).parent


def test_the_bundle_holds_every_module_and_the_agent_imports_from_it_alone(tmp_path):
    bundle = rootfs.agent_bundle(tmp_path)
    # The bundle copies the package's top level only: a subpackage would be left out.
    assert not [p for p in SOURCES.rglob("*.py") if p.parent != SOURCES]
    assert sorted(p.name for p in (bundle / "sandgate_agent").iterdir()) == sorted(p.name for p in SOURCES.glob("*.py"))
    # -I: no PYTHONPATH, no user site; the bundle is the only place sandgate_agent can come from.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import sandgate_agent.agent as a, sandgate_agent.kernel; "
            "print(a.__file__); a.main(['--help'])")
    out = subprocess.run([sys.executable, "-I", "-c", code, str(bundle)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == str(bundle / "sandgate_agent" / "agent.py")
    assert "--transport" in out.stdout
    # Named by the sources' hash: the same sources, the same bundle.
    assert rootfs.agent_bundle(tmp_path) == bundle
