#!/usr/bin/env bash
# Rebuild the Lab extension's JavaScript into sandgate_lab/labextension/ after a change to
# src/, style/ or package.json; commit the result. The build is committed so that
# `pip install .` needs no node: see docs/jupyterlab.md ("The extension's build").
# Needs node >= 18 with npm (the npm registry reachable) and the jupyterlab Python package,
# whose staging/package.json lists the versions the host Lab shares with extensions.
set -euo pipefail
cd "$(dirname "$0")"
# node_modules as package-lock.json pins it (npm ci again only when the lock file changed)
[ node_modules/.package-lock.json -nt package-lock.json ] || npm ci --no-audit --no-fund --loglevel=error
npx tsc
staging=$(python -c 'import jupyterlab, os; print(os.path.join(os.path.dirname(jupyterlab.__file__), "staging"))')
rm -rf sandgate_lab/labextension
node node_modules/@jupyterlab/builder/lib/build-labextension.js --core-path "$staging" .
python -m sandgate_lab.buildstamp --write
