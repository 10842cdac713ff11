#!/bin/sh
# The daemon builds its GGUF block kernel (kernels/qmatmul.cpp) with a C++ compiler at first
# start. Install Debian's g++ when no compiler is there (as root, or through sudo). With
# --optional (make install) a machine where that is not possible only gets a note: the daemon
# then serves dense weights. Without it (make test) that is an error: the tests build the kernel.
set -eu
if command -v "${CXX:-c++}" >/dev/null 2>&1; then
  exit 0
fi
OPTIONAL=0
[ "${1-}" = "--optional" ] && OPTIONAL=1
fail() {
  echo "$1" >&2
  [ "$OPTIONAL" = 1 ] && exit 0
  exit 1
}
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || fail "no C++ compiler and this user cannot install one: run 'apt-get install g++' as root (without it the daemon serves dense weights, slower)"
  SUDO="sudo"
fi
command -v apt-get >/dev/null 2>&1 || fail "no C++ compiler and no apt-get: install one (g++ or clang++) for the GGUF block kernel (without it the daemon serves dense weights, slower)"
echo "installing g++ (Debian package) for the GGUF block kernel" >&2
export DEBIAN_FRONTEND=noninteractive
{ $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends g++ >/dev/null; } ||
  fail "installing g++ failed (without a C++ compiler the daemon serves dense weights, slower)"
