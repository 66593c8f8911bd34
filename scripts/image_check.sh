#!/usr/bin/env bash
# Build the polytrain image with podman and run every job a team runs in it (docker/README.md,
# "Checking an image"). Needs root, podman, runc and mmdebstrap (scripts/setup.sh --all installs them).
#
#   bash scripts/image_check.sh                       # base image, Dockerfile.cpu, every check
#   bash scripts/image_check.sh --no-build --only info,multi-host
#   bash scripts/image_check.sh --help
#
# Exit status: 0 every check passed, 1 one failed, 2 it cannot run here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python3 docker/image_check.py "$@"
