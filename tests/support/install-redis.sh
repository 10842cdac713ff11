#!/bin/sh
# The test suite runs a real redis-server: Debian's package, installed when missing.
exec sh "$(dirname "$0")/apt-install.sh" "the Redis tests" "redis-server" redis-server
