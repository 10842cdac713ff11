#!/bin/sh
# The test suite runs a real redis-server. Install Debian's package when it is missing
# (as root, or through sudo); never skip the Redis tests instead.
set -eu
if command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || {
    echo "redis-server is missing and this user cannot install it: run 'apt-get install redis-server' as root" >&2
    exit 1
  }
  SUDO="sudo"
fi
echo "installing redis-server (Debian package) for the test suite" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq redis-server >/dev/null
