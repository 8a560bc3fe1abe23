#!/usr/bin/env bash
# The system tools `make images` and `make images push` need, installed from the host's Debian packages when
# missing: buildah (builds and pushes without a Docker engine) and, for the base image, mmdebstrap.
# A fresh CI machine has neither; `make test` calls this for buildah (its registry test pushes a small image).
# The real node (`make test-real-node`) also needs runc and nft: a tool named `command:package` is installed from that
# package.
# Usage: images/tools.sh buildah [mmdebstrap] [runc] [nft:nftables]
set -euo pipefail
missing=()
for tool in "$@"; do
  command -v "${tool%%:*}" >/dev/null || PATH=$PATH:/usr/sbin:/sbin command -v "${tool%%:*}" >/dev/null \
    || missing+=("${tool#*:}")
done
[ ${#missing[@]} -gt 0 ] || exit 0
SUDO=()
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "images: install ${missing[*]} (apt-get install ${missing[*]}): not root and no sudo" >&2; exit 2; }
  SUDO=(sudo)
fi
command -v apt-get >/dev/null || { echo "images: install ${missing[*]} with your package manager (no apt-get here)" >&2; exit 2; }
echo "images: installing ${missing[*]} (apt-get)"
"${SUDO[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
