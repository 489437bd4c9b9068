"""`sandgate image runsc`: Debian 13's runsc is used only if every byte checks out.

A mirror on 127.0.0.3 serves the real archive's signed InRelease with a tampered
index, or a forged InRelease: each is refused naming what failed, nothing is
installed. The real fetch itself runs in the driver suite (tests/test_drivers.py).
"""

from __future__ import annotations

import http.server
import threading
import urllib.request
from pathlib import Path

import pytest

from sandgate_images import runsc


@pytest.fixture
def mirror(tmp_path):
    root = tmp_path / "mirror"
    (root / "dists" / runsc.SUITE / "main" / "binary-amd64").mkdir(parents=True)
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(root), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.3", 0), handler)
    server.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.3:{server.server_address[1]}"
    server.shutdown()


def real_inrelease() -> bytes:
    with urllib.request.urlopen(f"http://deb.debian.org/debian/dists/{runsc.SUITE}/InRelease", timeout=120) as r:
        return r.read()


def test_a_forged_release_is_refused(mirror, tmp_path):
    root, url = mirror
    (root / "dists" / runsc.SUITE / "InRelease").write_bytes(real_inrelease().replace(b"Suite: stable", b"Suite: forged"))
    with pytest.raises(runsc.FetchError, match="does not verify against"):
        runsc.fetch(tmp_path / "home", mirror=url)
    assert runsc.installed(tmp_path / "home") is None


def test_a_tampered_index_is_refused(mirror, tmp_path):
    root, url = mirror
    d = root / "dists" / runsc.SUITE
    d.joinpath("InRelease").write_bytes(real_inrelease())
    d.joinpath(runsc.INDEX).write_bytes(b"\xfd7zXZ\x00 not the index")
    with pytest.raises(runsc.FetchError, match="does not match its SHA-256"):
        runsc.fetch(tmp_path / "home", mirror=url)
    assert runsc.installed(tmp_path / "home") is None
    assert [p.name for p in (tmp_path / "home" / "runsc").iterdir()] == []  # no half-made directory left


def test_an_unreachable_mirror_says_so(tmp_path):
    with pytest.raises(runsc.FetchError, match="cannot fetch http://127.0.0.3:9/"):
        runsc.fetch(tmp_path / "home", mirror="http://127.0.0.3:9")
