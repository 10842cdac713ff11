#!/bin/sh
# The status page is tested in a real headless browser: Debian's chromium driven by selenium
# through Debian's chromedriver (no browser is ever downloaded), installed when missing.
exec sh "$(dirname "$0")/apt-install.sh" "the status page's browser test" "chromium chromedriver" \
  chromium chromium-driver
