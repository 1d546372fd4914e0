#!/usr/bin/env bash
# Ray 2.60 for the GPU machine (Python 3.12, no internet), small enough to travel with a device call: its cp312
# wheel is 79 MB, over the 64 MiB a call carries. Keeps the core (raylet, GCS, the Python runtime) and drops
# the Java jars and the libraries megacritic does not use (rllib, tune, serve, data, train, air, llm, the
# dashboard's web client), then xz-compresses the tree (~20 MB). Also fetches the wheels of ray's
# dependencies the GPU image lacks (jsonschema and its own).
#   bash bench/ray_bundle.sh [.raywhl]
# On the GPU machine (carry .raywhl):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .raywhl/*.whl && tar -xJf .raywhl/ray-site.tar.xz -C /tmp/site
#   export PYTHONPATH=$PWD/src:/tmp/site RAY_AUTH_MODE=disabled
set -euo pipefail
OUT=${1:-.raywhl}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$OUT"
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$TMP" ray==2.60.0
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$OUT" jsonschema jsonschema-specifications referencing rpds-py
(cd "$TMP" && mkdir tree && cd tree && unzip -q ../ray-2.60.0-*.whl \
    && rm -rf ray/jars ray/rllib ray/tune ray/serve ray/data ray/llm ray/train ray/air ray/dashboard/client ray/workflow \
    && tar -cf - ray ray-2.60.0.dist-info | xz -T1 -9e --lzma2=dict=192MiB > "$TMP/ray-site.tar.xz")
mv "$TMP/ray-site.tar.xz" "$OUT/"
ls -la "$OUT"
