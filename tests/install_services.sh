#!/usr/bin/env bash
# The services the tests use, from Debian's packages: redis-server 7 (the streaming runtime's broker). Each test
# that needs one starts its own instance from this binary on a free port (tests/redis_helpers.py) and stops it.
set -euo pipefail
if ! command -v redis-server >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q redis-server >/dev/null
fi
redis-server --version
