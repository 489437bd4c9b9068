"""The hash of the Lab extension's sources, kept beside its committed build
(``labextension/sources.sha256``), so a test notices sources changed without a rebuild.

``python -m sandgate_lab.buildstamp --write`` (run by lab/build.sh) writes it; without
``--write`` it exits 1 when the build does not match the sources.
"""

import hashlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAB = HERE.parent  # lab/: package.json, src/, style/
STAMP = HERE / "labextension" / "sources.sha256"


def sources() -> list:
    files = [LAB / "package.json", LAB / "package-lock.json", LAB / "tsconfig.json"]
    files += sorted((LAB / "src").glob("*.ts")) + sorted((LAB / "style").glob("*"))
    return files


def digest() -> str:
    h = hashlib.sha256()
    for f in sources():
        h.update(f.relative_to(LAB).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def main() -> int:
    if "--write" in sys.argv[1:]:
        STAMP.write_text(digest() + "\n")
        return 0
    if not STAMP.exists() or STAMP.read_text().strip() != digest():
        print(f"{STAMP} does not match lab/'s sources: run lab/build.sh and commit the build", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
