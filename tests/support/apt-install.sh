#!/bin/sh
# Installs the Debian packages a part of the test suite needs when one of its programs is missing
# (as root, or through sudo); the suite never skips those tests instead.
# Usage: apt-install.sh "WHAT FOR" "PROGRAM..." PACKAGE...
set -eu
why=$1 programs=$2
shift 2
missing=""
for program in $programs; do
  command -v "$program" >/dev/null 2>&1 || [ -x "/usr/bin/$program" ] || missing="$missing $program"
done
[ -z "$missing" ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || {
    echo "missing:$missing; this user cannot install it: run 'apt-get install $*' as root" >&2
    exit 1
  }
  SUDO="sudo"
fi
echo "installing $* (Debian packages) for $why" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq "$@" >/dev/null
