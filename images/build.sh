#!/usr/bin/env bash
# `make images`: build images/<name>.Dockerfile for real, with no Docker engine and no base image pulled from a
# registry. buildah (daemonless, rootful, chroot isolation, vfs storage: no overlay mounts or user namespaces
# needed, so it runs inside an unprivileged container as well) builds FROM a base image made here from Debian's
# packages by mmdebstrap (minbase + python3 + venv + CA certificates), with the host's own apt sources.
# pip still installs Loom's Python dependencies from the package index while the images build.
#
# Usage: images/build.sh [operator|server|trainer|features|vllm ...]   (default: operator)
# Then the operator image is started once (`loom --version`, as the image's non-root user) and the sizes are
# printed and written to $STATE/report.txt. Needs: apt-get install buildah mmdebstrap.
# Images stay in $STATE/storage (buildah --root); copy one out with e.g.
#   buildah --root .state/images/storage --runroot .state/images/run push localhost/loom/operator:0.1.0 \
#     oci-archive:/tmp/loom-operator.tar
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${LOOM_IMAGES_STATE:-$ROOT/.state/images}
SUITE=${LOOM_IMAGES_SUITE:-bookworm}
BASE=localhost/loom-base:$SUITE
# The chart's appVersion: the tag `make images push` pushes and the chart's default tag.
VERSION=$(python3 -c 'import sys; sys.path[:0] = [sys.argv[1]]; import push; print(push.app_version())' "$ROOT/images")
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(operator)

for tool in buildah mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "images: '$tool' is not installed (apt-get install buildah mmdebstrap)" >&2; exit 2; }
done
for name in "${NAMES[@]}"; do
  [ -f "$ROOT/images/$name.Dockerfile" ] || { echo "images: no images/$name.Dockerfile" >&2; exit 2; }
done

mkdir -p "$STATE"
# vfs: plain copies of each layer; no kernel overlay or fuse needed (bigger on disk, fine for a build host).
BUILDAH=(buildah --root "$STATE/storage" --runroot "$STATE/run" --storage-driver vfs)
export BUILDAH_ISOLATION=chroot
now() { date +%s; }
REPORT=$STATE/report.txt
echo "== $(date -u +%FT%TZ) images/build.sh ${NAMES[*]}" >>"$REPORT"
log() { echo "images: $*" | tee -a "$REPORT"; }

# The host's apt sources (a deb822 file or a sources.list): no mirror is named here.
sources() {
  local f
  for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    [ -s "$f" ] && { echo "$f"; return; }
  done
  echo "images: no apt sources on this host (/etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list)" >&2
  exit 2
}

# LOOM_IMAGES_BASE_ARCHIVE: a `docker save` archive of that same base (the local stack's real node makes one, its
# development image: devstack/cluster/realnode/images.py), imported instead of running mmdebstrap a second time.
BASE_ARCHIVE=${LOOM_IMAGES_BASE_ARCHIVE:-}
if ! "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1 && [ -n "$BASE_ARCHIVE" ]; then
  [ -s "$BASE_ARCHIVE" ] || { echo "images: LOOM_IMAGES_BASE_ARCHIVE=$BASE_ARCHIVE is not a file" >&2; exit 2; }
  start=$(now)
  imported=$("${BUILDAH[@]}" pull --quiet "docker-archive:$BASE_ARCHIVE")
  "${BUILDAH[@]}" tag "$imported" "$BASE"
  log "base $BASE imported from $BASE_ARCHIVE in $(( $(now) - start )) s"
elif ! "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  start=$(now)
  rootfs=$STATE/rootfs-$SUITE.tar
  # minbase: Essential and Priority:required packages (dpkg, bash, coreutils, passwd for useradd) plus apt;
  # documentation and translations left out.
  mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --aptopt='Acquire::Languages "none"' \
    "$SUITE" "$rootfs" "$(sources)"
  ctr=$("${BUILDAH[@]}" from scratch)
  "${BUILDAH[@]}" add "$ctr" "$rootfs" /
  "${BUILDAH[@]}" config --env LANG=C.UTF-8 --cmd '["python3"]' \
    --label org.opencontainers.image.description="Debian $SUITE minbase with python3, made by mmdebstrap" "$ctr"
  "${BUILDAH[@]}" commit --quiet --rm "$ctr" "$BASE" >/dev/null
  rm -f "$rootfs"
  log "base $BASE made from Debian packages in $(( $(now) - start )) s"
else
  log "base $BASE already in $STATE/storage"
fi

# The host's CA bundle (it may trust a TLS-inspecting egress proxy the base's own bundle does not) and a pip
# setting that uses it, bind-mounted into the RUN steps only: neither is copied into any image layer.
HOST_CA=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
[ -s "$HOST_CA" ] || { echo "images: no CA bundle at $HOST_CA (set SSL_CERT_FILE)" >&2; exit 2; }
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$STATE/pip.conf"
BUILD_MOUNTS=(-v "$HOST_CA:/etc/ssl/certs/ca-certificates.crt:ro" -v "$STATE/pip.conf:/etc/pip.conf:ro")

for name in "${NAMES[@]}"; do
  start=$(now)
  # --pull=never: every FROM must already be local (the base above, or an earlier stage). --force-rm: a failed
  # build's working container is removed too (with vfs it is a full copy of the filesystem: gigabytes of torch).
  "${BUILDAH[@]}" bud --isolation chroot --pull=never --layers=false --force-rm "${BUILD_MOUNTS[@]}" \
    --build-arg "BASE=$BASE" -f "$ROOT/images/$name.Dockerfile" -t "localhost/loom/$name:$VERSION" "$ROOT"
  log "built localhost/loom/$name:$VERSION in $(( $(now) - start )) s"
done

# Each image started once, as its own user with its own PATH: the operator's CLI answers, the workloads import
# (and the entrypoints the operator's pods run answer --help).
smoke() {
  case $1 in
    operator) echo "loom --version" ;;
    server) echo "python -c 'import torch, loom.workloads.server.app; print(\"torch\", torch.__version__)'" ;;
    vllm) echo "python -c 'import vllm, loom.workloads.llm.app, loom.workloads.server.fetch; print(\"vllm\", vllm.__version__)'" ;;
    features) echo "python -m loom.workloads.features --help >/dev/null &&
      python -c 'import feast, loom.workloads.features.commands; print(\"feast\", feast.__version__)'" ;;
    trainer) echo "torchrun --help >/dev/null && python -m loom.workloads.trainer --help >/dev/null &&
      python -c 'import torch, deepspeed, loom.workloads.trainer.loop, loom.workloads.trainer.engines;
print(\"torch\", torch.__version__, \"deepspeed\", deepspeed.__version__)'" ;;
  esac
}
for name in "${NAMES[@]}"; do
  ctr=$("${BUILDAH[@]}" from --pull=never "localhost/loom/$name:$VERSION")
  trap '"${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
  said=$("${BUILDAH[@]}" run --isolation chroot "$ctr" -- sh -c "$(smoke "$name")")
  uid=$("${BUILDAH[@]}" run --isolation chroot "$ctr" -- id -u)
  log "$name image runs: '$said' as uid $uid"
  [ "$uid" != 0 ] || { echo "images: the $name image runs as root" >&2; exit 1; }
  "${BUILDAH[@]}" rm "$ctr" >/dev/null
done

log "sizes:"
"${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' | tee -a "$REPORT"
