#!/bin/sh
# The status page is tested in a real headless browser: Debian's chromium (driven by playwright
# from PyPI against /usr/bin/chromium; no browser is ever downloaded by playwright). Install the
# Debian packages when missing (as root, or through sudo); never skip the browser test instead.
set -eu
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || {
    echo "chromium is missing and this user cannot install it: run 'apt-get install chromium chromium-driver' as root" >&2
    exit 1
  }
  SUDO="sudo"
fi
echo "installing chromium (Debian package) for the status page's browser test" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
