#!/usr/bin/env bash
# Creates build/venv-triton36: Triton 3.6 (the GPU machine's version) on top of the project venv's
# packages (torch, numpy, pytest come from .venv through a .pth file; triton 3.6 shadows 3.9 because a
# venv's own site-packages comes first on sys.path). tests/kernels/test_hopper_compile.py compiles
# every kernel with it as well when it exists (and says it skipped otherwise). No make needed:
#     bash benchmarks/triton36_venv.sh          (about 1 minute; a ~200 MB wheel from PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE_VENV:-.venv}
DEST=${DEST:-build/venv-triton36}
VERSION=${TRITON36_VERSION:-3.6.0}
py="$BASE/bin/python"
"$py" -m venv --without-pip "$DEST" 2>/dev/null || "$(readlink -f "$py")" -m venv --without-pip "$DEST"
site_base=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site_dest=$("$DEST/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$(readlink -f "$site_base")" > "$site_dest/_base_venv.pth"
"$py" -m pip install --quiet --no-deps --target "$site_dest" "triton==$VERSION"
"$DEST/bin/python" -c 'import triton, torch; print("triton", triton.__version__, "torch", torch.__version__)'
