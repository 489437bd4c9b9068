"""A newer runsc beside the system's: Debian 13's gVisor, fetched from the Debian archive.

Debian 12's runsc (0.0~20221219) stops a sandbox to checkpoint it; Debian 13's
(0.0~20240729) can checkpoint it in place (`--leave-running`). Its package is one
static binary with no dependencies, so it is unpacked under the Sandgate home and
used through SANDGATE_RUNSC, leaving the system's packages alone.

Every byte is checked the way apt checks it: InRelease's signature with gpgv
against the system's Debian archive keyring (bookworm's holds trixie's keys), the
Packages index by the SHA-256 InRelease gives, the .deb by the SHA-256 the index gives.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Callable, Dict, Optional

SUITE = "trixie"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
INDEX = "main/binary-amd64/Packages.xz"


class FetchError(RuntimeError):
    pass


def runsc_dir(home: Path) -> Path:
    return home / "runsc" / SUITE


def installed(home: Path) -> Optional[Path]:
    path = runsc_dir(home) / "runsc"
    return path if os.access(path, os.X_OK) else None


def _get(url: str, timeout: float = 120) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except OSError as e:
        raise FetchError(f"cannot fetch {url}: {e}") from None


def _stanza(packages: str, name: str) -> Dict[str, str]:
    for block in packages.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(" "))
        if fields.get("Package") == name:
            return fields
    raise FetchError(f"no {name} package in {SUITE}'s {INDEX}")


def _verified_release(mirror: str, tmp: Path) -> str:
    signed = tmp / "InRelease"
    signed.write_bytes(_get(f"{mirror}/dists/{SUITE}/InRelease"))
    out = tmp / "Release"
    p = subprocess.run(["gpgv", "--keyring", KEYRING, "--output", str(out), str(signed)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise FetchError(f"{SUITE}'s InRelease does not verify against {KEYRING}: {p.stderr.strip()[-300:]}")
    return out.read_text()


def _sha256_of(release: str, name: str) -> str:
    in_sha = False
    for line in release.splitlines():
        if not line.startswith(" "):
            in_sha = line.startswith("SHA256:")
        elif in_sha and line.split()[-1] == name:
            return line.split()[0]
    raise FetchError(f"{SUITE}'s Release lists no SHA-256 for {name}")


def fetch(home: Path, mirror: Optional[str] = None,
          progress: Callable[[str], None] = lambda s: None) -> Path:
    """Unpack Debian 13's runsc under ``home`` (once) and return its path."""
    if installed(home):
        return installed(home)
    if not shutil.which("gpgv") or not os.path.exists(KEYRING):
        raise FetchError(f"gpgv and {KEYRING} are needed to check the download (apt-get install gpgv debian-archive-keyring)")
    mirror = (mirror or os.environ.get("SANDGATE_DEBIAN_MIRROR", "http://deb.debian.org/debian")).rstrip("/")
    dest = runsc_dir(home)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as t:
        tmp = Path(t)
        progress(f"checking {SUITE}'s release at {mirror}")
        release = _verified_release(mirror, tmp)
        index = _get(f"{mirror}/dists/{SUITE}/{INDEX}")
        if hashlib.sha256(index).hexdigest() != _sha256_of(release, INDEX):
            raise FetchError(f"{INDEX} does not match its SHA-256 in {SUITE}'s Release")
        pkg = _stanza(lzma.decompress(index).decode(), "runsc")
        progress(f"fetching runsc {pkg['Version']} ({int(pkg['Size']) >> 20} MB)")
        deb = _get(f"{mirror}/{pkg['Filename']}", timeout=600)
        if hashlib.sha256(deb).hexdigest() != pkg["SHA256"]:
            raise FetchError(f"{pkg['Filename']} does not match its SHA-256 in {INDEX}")
        (tmp / "runsc.deb").write_bytes(deb)
        p = subprocess.run(["dpkg-deb", "-x", str(tmp / "runsc.deb"), str(tmp / "x")], capture_output=True, text=True)
        binary = tmp / "x" / "usr" / "bin" / "runsc"
        if p.returncode != 0 or not binary.is_file():
            raise FetchError(f"cannot unpack {pkg['Filename']}: {p.stderr.strip()[-300:] or 'no usr/bin/runsc in it'}")
        staged = tmp / "out"
        staged.mkdir()
        shutil.move(str(binary), staged / "runsc")
        (staged / "VERSION").write_text(pkg["Version"] + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staged, dest)  # whole or not at all: a half-written binary is never found
    return dest / "runsc"
