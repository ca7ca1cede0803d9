#!/usr/bin/env bash
# Installs everything Halyard needs to build and test, idempotently: Debian
# packages (compilers' friends: Eigen, GoogleTest, Google Benchmark, OpenMPI,
# nlohmann-json; clang 16 with its sanitizer and libFuzzer runtimes for
# scripts/sanitize.sh; bible-kjv, the text the main job trains on) and a project-local venv (.venv) holding the official Halide
# 21.0.0 wheel plus recent cmake and ninja (Halide 21's CMake package needs
# CMake >= 3.28; Debian 12 ships 3.25). A second run checks and does nothing.
#
# Writes .venv/halyard.env, which the other scripts source: it puts the venv's
# cmake first on PATH and names the Halide CMake package to use.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"

apt_packages=(build-essential pkg-config python3-venv python3-dev
  libeigen3-dev libgtest-dev libgmock-dev libbenchmark-dev
  libopenmpi-dev openmpi-bin nlohmann-json3-dev ninja-build
  clang-16 libclang-rt-16-dev  # scripts/sanitize.sh: ASan, UBSan, libFuzzer
  ocl-icd-libopencl1 pocl-opencl-icd  # OpenCL on the CPU: the GPU schedule and device path run in tests
  bible-kjv)  # the main job's corpus: the King James Bible (public domain), 4.3 MB of text

missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] installing Debian packages: ${missing[*]}"
  sudo_cmd=(); [ "$(id -u)" = 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq
  "${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The venv: prefer the python3 on PATH; Debian's python3-venv is installed above
# for the case where that python is the system one.
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  python3 -m venv "$venv" || /usr/bin/python3 -m venv "$venv"
fi
py="$venv/bin/python"

halide_dir=""
if ! "$py" -c "import halide, cmake, ninja" 2>/dev/null \
   || [ "$("$py" -c 'import importlib.metadata as m; print(m.version("halide"))' 2>/dev/null)" != "21.0.0" ]; then
  echo "[setup] installing halide==21.0.0, cmake, ninja into $venv"
  if ! "$py" -m pip install -q --disable-pip-version-check "halide==21.0.0" "cmake>=3.28" ninja; then
    echo "[setup] warning: the halide 21.0.0 wheel could not be installed." >&2
  fi
fi
if "$py" -c "import halide" 2>/dev/null; then
  # The wheel puts its CMake package under lib/ or lib64/ depending on the build.
  halide_dir=$(dirname "$(find "$("$py" -c 'import halide; print(halide.install_dir())')" \
    -path '*/cmake/Halide/HalideConfig.cmake' | head -n 1)")
else
  # The fallback: Debian's Halide 14 (needs LLVM 14's CMake files); CMakeLists.txt then names the version it needs.
  echo "[setup] falling back to Debian's Halide 14 (libhalide14-0-dev); features of Halide 21 will be missing." >&2
  for p in libhalide14-0-dev llvm-14-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || \
      apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "$p"
  done
  halide_dir=$(dirname "$(ls /usr/lib/x86_64-linux-gnu/cmake/Halide14/HalideConfig.cmake 2>/dev/null || true)")
  [ -n "$halide_dir" ] || { echo "error: neither the halide wheel nor libhalide14-0-dev could be installed; check that PyPI or Debian's mirror is reachable." >&2; exit 1; }
fi

cmake_bin="$venv/bin/cmake"; [ -x "$cmake_bin" ] || cmake_bin=$(command -v cmake)
cat > "$venv/halyard.env" <<ENV
export PATH="$venv/bin:\$PATH"
export HALYARD_CMAKE="$cmake_bin"
export HALYARD_HALIDE_DIR="$halide_dir"
ENV
echo "[setup] ok: $("$cmake_bin" --version | head -1), Halide package at $halide_dir"
