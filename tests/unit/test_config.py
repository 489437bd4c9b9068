"""Settings declared once (gateway/config.py): read from the environment and flags there alone,
checked at start with one line naming the setting, and handed to the modules that use them."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sandgate
from sandgate import config, trace
from sandgate.config import CommandSettings, Settings
from sandgate.drivers.gvisor import GVisorDriver
from sandgate.drivers.firecracker import FirecrackerDriver

GATEWAY = Path(sandgate.__file__).parent

# Deployments set these: a name may be added, never renamed or dropped.
KNOWN = """SANDGATE_IP SANDGATE_PORT SANDGATE_TOKEN SANDGATE_ALLOW_ORIGIN SANDGATE_MAX_KERNELS SANDGATE_CULL_IDLE_TIMEOUT
SANDGATE_CULL_INTERVAL SANDGATE_PAUSE_IDLE_TIMEOUT SANDGATE_WARM_START SANDGATE_POOL_SIZE SANDGATE_DRIVER SANDGATE_HOME
SANDGATE_ENV_ALLOW SANDGATE_MAX_MESSAGE_MB SANDGATE_MAX_CODE_MB SANDGATE_CLIENT_MEMORY_MB SANDGATE_MAX_CLIENTS_PER_KERNEL
SANDGATE_KERNEL_START_TIMEOUT SANDGATE_HTTP_IDLE_TIMEOUT SANDGATE_HTTP_BODY_TIMEOUT SANDGATE_HTTP_MAX_CONNECTIONS
SANDGATE_HTTP_MAX_CONNECTIONS_PER_CLIENT SANDGATE_MAX_MEMORY_MB SANDGATE_MAX_CPUS SANDGATE_MAX_PIDS SANDGATE_MAX_DISK_MB
SANDGATE_MAX_TTL SANDGATE_HELD_MESSAGES SANDGATE_HELD_MB SANDGATE_SHUTDOWN_PARALLEL SANDGATE_KEEP_SANDBOXES
SANDGATE_CHECKPOINT_MAX_BYTES SANDGATE_CHECKPOINT_MAX_NEW_BYTES SANDGATE_CHECKPOINT_MAX_FILES SANDGATE_CHECKPOINT_STORE
SANDGATE_KEPT_IMAGES_MB SANDGATE_EXECUTE_OUTPUT_MB SANDGATE_CLIENT_BUFFER_MB SANDGATE_IOPUB_MSG_RATE
SANDGATE_IOPUB_DATA_RATE SANDGATE_TENANT_MAX_SANDBOXES SANDGATE_TENANT_MAX_MEMORY_MB SANDGATE_TENANT_MAX_CHECKPOINT_MB
SANDGATE_TENANT_CREATE_RATE SANDGATE_TENANT_CREATE_BURST SANDGATE_TENANT_KEY SANDGATE_EGRESS_CA_BUNDLE
SANDGATE_EGRESS_HOSTS SANDGATE_REDIS_URL SANDGATE_REDIS_PREFIX SANDGATE_NODE_ID SANDGATE_NODE_URL
SANDGATE_GATEWAY_MEMORY_MB SANDGATE_FLEET_KEY SANDGATE_FLEET_KEY_FILE SANDGATE_REDIS_CA_FILE SANDGATE_REDIS_CERT_FILE
SANDGATE_REDIS_KEY_FILE SANDGATE_MEMORY_MB SANDGATE_CPUS SANDGATE_PIDS SANDGATE_DISK_MB SANDGATE_SANDBOX_UID
SANDGATE_RUNSC SANDGATE_RUNSC_PLATFORM SANDGATE_RUNSC_RECLAIM SANDGATE_CHECKPOINT_IN_PLACE SANDGATE_RUNSC_COMPRESSION
SANDGATE_TRACE SANDGATE_QEMU_ACCEL SANDGATE_QEMU_APPEND FIRECRACKER_BIN SANDGATE_FIRECRACKER_JAILER
SANDGATE_FIRECRACKER_UID SANDGATE_FIRECRACKER_GID SANDGATE_FIRECRACKER_CHROOT_BASE SANDGATE_FIRECRACKER_JAILER_ARGS
SANDGATE_FIRECRACKER_IMAGE SANDGATE_LOG_LEVEL SANDGATE_LOG_FORMAT SANDGATE_URL""".split()


def environment_reads(path: Path) -> list:
    """Lines of path that read the process's environment: os.getenv, os.environ.get/items/...,
    os.environ[...] and `in os.environ` (passing os.environ on to a child is not a read)."""

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in ("environ", "environb")

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and (node.attr in ("getenv", "getenvb") or is_environ(node.value)):
            found.add(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            found.add(node.lineno)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            found.add(node.lineno)
    return sorted(found)


def test_only_the_config_module_reads_the_environment():
    reads = {str(p.relative_to(GATEWAY)): lines for p in GATEWAY.rglob("*.py")
             if (lines := environment_reads(p)) and p.name != "config.py"}
    assert reads == {}
    assert environment_reads(GATEWAY / "config.py")  # the scan sees a read where there is one


def test_every_known_variable_is_still_read():
    declared = {d.env for d in [*config.SETTINGS, *config.COMMAND] if d.env}
    assert sorted(set(KNOWN) - declared) == []


def test_a_bad_value_is_one_line_naming_its_variable_and_flag(monkeypatch):
    for variable, value, named in (("SANDGATE_MAX_KERNELS", "lots", "max_kernels (SANDGATE_MAX_KERNELS, --max-kernels)"),
                                   ("SANDGATE_RUNSC_RECLAIM", "maybe", "runsc_reclaim (SANDGATE_RUNSC_RECLAIM"),
                                   ("SANDGATE_QEMU_ACCEL", "hvf", "qemu_accel (SANDGATE_QEMU_ACCEL"),
                                   ("SANDGATE_FIRECRACKER_UID", "-1", "firecracker_uid (SANDGATE_FIRECRACKER_UID"),
                                   ("SANDGATE_MEMORY_MB", "1", "memory_mb (SANDGATE_MEMORY_MB, --memory-mb)")):
        monkeypatch.setenv(variable, value)
        with pytest.raises(SystemExit) as e:
            Settings.load()
        message = str(e.value)
        assert message.startswith("sandgate: invalid setting: ") and named in message and "\n" not in message
        monkeypatch.delenv(variable)
    monkeypatch.setenv("SANDGATE_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit, match=r"log_format \(SANDGATE_LOG_FORMAT, --log-format\)"):
        CommandSettings.load()


def test_a_flag_wins_and_an_empty_number_is_unset(monkeypatch):
    monkeypatch.setenv("SANDGATE_MAX_KERNELS", "5")
    monkeypatch.setenv("SANDGATE_FIRECRACKER_GID", "")
    monkeypatch.setenv("SANDGATE_TOKEN", "")  # text: empty is a value (auth off)
    monkeypatch.setenv("SANDGATE_ENV_ALLOW", "A,,B")
    monkeypatch.setenv("SANDGATE_TRACE", "yes")
    s = Settings.load(max_kernels=None, cpus="2")
    assert (s.max_kernels, s.firecracker_gid, s.token, s.env_allow, s.limits.cpus) == (5, None, "", ["A", "B"], 2.0)
    assert s.trace is True and trace.ENABLED is False  # on only once the gateway says so (serve)
    assert Settings.load(max_kernels="7").max_kernels == 7
    with pytest.raises(TypeError, match="max_kernel"):
        Settings.load(max_kernel=7)


def test_the_drivers_take_their_settings_not_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SANDGATE_RUNSC_PLATFORM", "kvm")
    monkeypatch.setenv("SANDGATE_FIRECRACKER_UID", "5")
    s = Settings(runsc="/opt/runsc/runsc", runsc_platform="systrap", runsc_reclaim="false", firecracker_uid=77)
    args = GVisorDriver(str(tmp_path / "home" / "runtime" / "gvisor"), s).runsc_args()
    assert args[0] == "/opt/runsc/runsc" and "--platform=systrap" in args and "--profile" not in args
    fc = FirecrackerDriver(str(tmp_path / "home" / "runtime" / "firecracker"), s)
    assert (fc.uid, fc.gid) == (77, 77)


def test_serve_help_has_a_flag_for_every_setting_but_the_secrets():
    out = subprocess.run([sys.executable, "-m", "sandgate.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    for d in config.SETTINGS:
        if d.flag:
            assert d.flag in out.stdout
        elif d.env:
            assert d.env in out.stdout  # named in the list of variable-only settings
    assert "--fleet-key " not in out.stdout and "SANDGATE_FLEET_KEY" in out.stdout


def test_the_runtime_lease_is_on_by_default_in_a_fleet_only():
    # Alone, nobody takes a sandbox over: its runtime waits for the next gateway however long it is down.
    assert Settings().lease_seconds == 0
    assert Settings(redis_url="redis://127.0.0.3:6379/0").lease_seconds == 120
    assert Settings(runtime_lease=30).lease_seconds == 30
    assert Settings(redis_url="redis://127.0.0.3:6379/0", runtime_lease=0).lease_seconds == 0
