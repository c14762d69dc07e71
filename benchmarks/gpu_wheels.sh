#!/usr/bin/env bash
# Wheels for a CUDA PyTorch machine that reaches no package index: the runtime dependencies such an
# image usually lacks (megatron-core, Hydra, PyTriton and their own needs), at constraints.txt's
# versions, for one Python version on x86-64 Linux. Wheels over 16 MB are recompressed with LZMA
# (PyTriton's 55 MB wheel becomes 37 MB; pip installs them as usual), so that the set travels in
# under 64 MB.
#
#   benchmarks/gpu_wheels.sh [DEST=.whl] [PYTHON_VERSION=3.12]
#
# On the GPU machine, from the repository root:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DEST/*.whl && export PYTHONPATH=/tmp/site:$PWD
# benchmarks/gpu_checks.sh does this itself when ./.whl exists.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYV=${2:-3.12}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
PACKAGES="megatron-core hydra-core omegaconf nvidia-pytriton tritonclient python-rapidjson pyzmq sh importlib_metadata
  geventhttpclient gevent greenlet zope.event zope.interface brotli"
PLATFORMS=""
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 \
  manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  PLATFORMS="$PLATFORMS --platform ${tag}_x86_64"
done
mkdir -p "$DEST"
pins=()
for p in $PACKAGES; do
  pin=$(grep -i -E "^${p//./\\.}==" constraints.txt || true)
  [ -n "$pin" ] || { echo "gpu_wheels.sh: $p has no pin in constraints.txt" >&2; exit 1; }
  pins+=("$pin")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  $PLATFORMS --platform any -d "$DEST" "${pins[@]}"
# antlr4-python3-runtime (Hydra's parser) is published only as a source archive: build its pure-Python wheel.
"$PY" -m pip wheel -q --no-deps -w "$DEST" "$(grep -i '^antlr4-python3-runtime==' constraints.txt)"
"$PY" - "$DEST" <<'EOF'
import os, sys, zipfile
dest = sys.argv[1]
for name in sorted(os.listdir(dest)):
    path = os.path.join(dest, name)
    if not name.endswith(".whl") or os.path.getsize(path) < 16e6:
        continue
    with zipfile.ZipFile(path) as src:
        if all(i.compress_type == zipfile.ZIP_LZMA for i in src.infolist()):
            continue
        with zipfile.ZipFile(path + ".tmp", "w") as out:
            for info in src.infolist():
                out.writestr(info, src.read(info), compress_type=zipfile.ZIP_LZMA)
    os.replace(path + ".tmp", path)
EOF
ls -la "$DEST"
du -sh --apparent-size "$DEST"
