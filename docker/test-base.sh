#!/usr/bin/env bash
# Copy of shared/tools/docker-test-base.sh, kept in the repository so that CI (a clean clone) has it.
# Make a local Docker base image for building and running the project's image on a machine that
# cannot pull from image registries: a minimal Debian (debootstrap), plus this machine's CA
# certificates so that pip inside the build can reach the package index through a TLS proxy.
#
#   usage: docker-test-base.sh [TAG]        (default TAG: padim-test-base:bookworm)
#   then:  docker build --network host --build-arg CUDA_IMAGE=padim-test-base:bookworm .
#
# Needs root, Debian's docker.io and debootstrap packages (installed here when missing) and a
# running dockerd (started here when none answers). Idempotent: an existing TAG is kept.
set -euo pipefail
tag=${1:-padim-test-base:bookworm}
need=()
# dockerd, not docker: some machines have the client alone, and the engine is what the tests need
if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then need+=(docker.io); fi
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  (dockerd >/tmp/dockerd.log 2>&1 &)
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  if ! docker info >/dev/null 2>&1; then
    echo "dockerd did not start; the end of /tmp/dockerd.log:" >&2
    tail -20 /tmp/dockerd.log >&2 || true
    exit 1
  fi
fi
if docker image inspect "$tag" >/dev/null 2>&1; then echo "$tag exists"; exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
debootstrap --variant=minbase bookworm "$work/rootfs" >"$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
tar -C "$work/rootfs" -c . | docker import - "$tag-rootfs" >/dev/null
mkdir -p "$work/ctx/certs"
# one file per certificate, so that update-ca-certificates in a later apt step keeps them
awk 'BEGIN{n=0} /BEGIN CERTIFICATE/{n++; f=sprintf("'"$work"'/ctx/certs/c%04d.crt",n)} {if(n>0) print > f}' \
  /etc/ssl/certs/ca-certificates.crt
cp /etc/ssl/certs/ca-certificates.crt "$work/ctx/ca-certificates.crt"
cat >"$work/ctx/Dockerfile" <<DOCKERFILE
FROM $tag-rootfs
COPY certs/ /usr/local/share/ca-certificates/host/
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
DOCKERFILE
docker build -q -t "$tag" "$work/ctx" >/dev/null
echo "$tag ready"
