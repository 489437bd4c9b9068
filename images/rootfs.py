"""The default sandbox image: a Debian root filesystem built by mmdebstrap.

The image is named by a hash of its recipe (suite, package list, options and
the recipe version), so a changed recipe builds a new image beside the old
one and an unchanged one is reused from the cache. The build is written to a
temporary directory and renamed into place only when complete, so an
interrupted build never leaves a half image that looks finished. Each image
records the exact package versions it got in ``manifest.json``.

The guest agent is not baked in: it is a separate, equally content-hashed
directory (see ``agent_bundle``), so changing the agent does not rebuild the
Debian root.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

RECIPE = {
    "version": 1,
    "suite": "bookworm",
    "variant": "essential",
    "packages": [
        "python3", "python3-ipykernel", "python3-jupyter-client", "python3-pydantic",
        "python3-numpy", "python3-pandas", "python3-matplotlib", "ca-certificates",
    ],
    # Documentation and translations are dead weight in a sandbox.
    "dpkg_excludes": ["/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*"],
    # Fixed timestamps make two builds of the same packages byte-identical.
    "source_date_epoch": 1700000000,
}
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def recipe_hash(recipe: dict = RECIPE) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def image_dir(home: Path, recipe: dict = RECIPE) -> Path:
    return home / "images" / f"debian-{recipe['suite']}-{recipe_hash(recipe)}"


def is_built(home: Path, recipe: dict = RECIPE) -> bool:
    return (image_dir(home, recipe) / "manifest.json").exists()


def build(home: Path, recipe: dict = RECIPE, mirror: Optional[str] = None,
          progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> Path:
    """Build the image unless it is cached; returns the image directory."""
    final = image_dir(home, recipe)
    if (final / "manifest.json").exists():
        progress(f"image {final.name} is cached")
        return final
    if not shutil.which("mmdebstrap"):
        raise RuntimeError("mmdebstrap not found: apt-get install mmdebstrap")
    mirror = mirror or os.environ.get("SANDGATE_DEBIAN_MIRROR", DEFAULT_MIRROR)
    tmp = final.with_name(final.name + f".building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = ["mmdebstrap", f"--variant={recipe['variant']}", "--include=" + ",".join(recipe["packages"]),
           "--aptopt=Acquire::Languages \"none\""]
    cmd += [f"--dpkgopt=path-exclude={p}" for p in recipe["dpkg_excludes"]]
    cmd += [recipe["suite"], str(tmp / "rootfs"), mirror]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(recipe["source_date_epoch"])}
    progress(f"building image {final.name} with mmdebstrap from {mirror} (about 2 minutes)")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, text=True)
    tail = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-20:]
        if line.startswith(("I:", "E:", "W:")):
            progress(f"  [{time.monotonic() - t0:5.1f}s] {line}")
    if proc.wait() != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError("mmdebstrap failed:\n" + "\n".join(tail))
    rootfs = tmp / "rootfs"
    (rootfs / "workspace").mkdir(exist_ok=True)
    (rootfs / "opt" / "sandgate").mkdir(parents=True, exist_ok=True)
    versions = subprocess.run(["dpkg-query", f"--admindir={rootfs}/var/lib/dpkg", "-W", "-f=${Package} ${Version}\n"],
                              capture_output=True, text=True).stdout.split("\n")
    manifest = {"name": final.name, "recipe": recipe, "mirror": mirror, "built": int(time.time()),
                "packages": dict(v.split(" ", 1) for v in versions if " " in v)}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    progress(f"image {final.name} built in {time.monotonic() - t0:.0f}s")
    return final


def agent_bundle(home: Path) -> Path:
    """Copy the guest agent's sources into a directory named by their hash,
    mounted read-only into sandboxes as /opt/sandgate."""
    import sandgate_agent

    src = Path(sandgate_agent.__file__).parent
    files = sorted(p for p in src.glob("*.py"))
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    dest = home / "agent" / h.hexdigest()[:16]
    if not (dest / "sandgate_agent" / "agent.py").exists():
        tmp = dest.with_name(dest.name + f".tmp-{uuid.uuid4().hex}")  # unique: threads build too
        (tmp / "sandgate_agent").mkdir(parents=True, exist_ok=True)
        for p in files:
            shutil.copy2(p, tmp / "sandgate_agent" / p.name)
        try:
            os.rename(tmp, dest)
        except OSError:  # built meanwhile by another thread or process
            shutil.rmtree(tmp)
    return dest
