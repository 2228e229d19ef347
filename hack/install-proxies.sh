#!/usr/bin/env bash
# Installs HAProxy and nginx from the distribution's packages for `make bench-proxy` (not part of
# `make test`): the side-by-side proxy benchmark runs the agent against them. Needs root (or
# sudo) and apt; does nothing when both are already installed.
set -euo pipefail
if command -v haproxy >/dev/null && command -v nginx >/dev/null; then
	exit 0
fi
SUDO=
if [ "$(id -u)" != 0 ]; then
	SUDO=sudo
fi
$SUDO apt-get update
# The packages' services are not wanted: the benchmark starts its own processes.
DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 $SUDO apt-get install -y --no-install-recommends haproxy nginx-light 2>/dev/null ||
	DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 $SUDO apt-get install -y --no-install-recommends haproxy nginx
