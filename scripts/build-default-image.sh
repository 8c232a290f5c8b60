#!/usr/bin/env bash
# build-default-image.sh OUT_DIR [KIND] builds a sandbox image rootfs made by Debian's
# mmdebstrap from Debian bookworm minbase, with the host name "sandbox" and localhost entries in
# /etc/hosts (image-identity.sh), never the build host's. KIND names the package set:
#   default   (the default) the image `make run` uses: bash, coreutils, procps, python3, git and
#             ca-certificates;
#   services  the default's packages with Debian's postgresql-15 (the cluster 15/main its
#             package creates, with the default configuration), redis-server and nodejs, for
#             the service rows of the process-shape tests (make image-services).
# It builds into a temp dir beside OUT_DIR and renames it into place, so OUT_DIR is either
# complete (with a stamp file) or absent. A second run with the same OUT_DIR does nothing.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
	echo "usage: $0 OUT_DIR [default|services]" >&2
	exit 2
fi
out=$1
kind=${2:-default}
stamp=.deltagym-image-stamp
suite=bookworm
include=bash,coreutils,procps,python3,git,ca-certificates
case "$kind" in
default) ;;
services) include=$include,postgresql-15,redis-server,nodejs ;;
*)
	echo "usage: $0 OUT_DIR [default|services]: unknown image kind $kind" >&2
	exit 2
	;;
esac

if [ -f "$out/$stamp" ]; then
	echo "build-default-image: $out is already built ($(head -n1 "$out/$stamp")); nothing to do"
	exit 0
fi
if [ -e "$out" ]; then
	echo "build-default-image: $out exists without $stamp (an interrupted or foreign build); remove it and retry" >&2
	exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
	echo "build-default-image: must run as root (the rootfs keeps real ownership and device nodes)" >&2
	exit 1
fi

here=$(cd "$(dirname "$0")" && pwd)
echo "build-default-image: [1/4] checking dependencies (mmdebstrap)"
"$here/deps.sh" image
if ! command -v mmdebstrap >/dev/null; then
	echo "build-default-image: mmdebstrap is not installed; run scripts/deps.sh image as root" >&2
	exit 1
fi

parent=$(dirname "$out")
mkdir -p "$parent"
tmp=$(mktemp -d "$parent/.build-default-image.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM # so that the EXIT trap cleans up
# apt's sandbox user _apt must be able to reach the target's partial downloads.
chmod 0755 "$tmp"

start=$SECONDS
echo "build-default-image: [2/4] mmdebstrap --variant=minbase --include=$include $suite (a minute or two)"
# The rootfs goes into a subdirectory: mmdebstrap wants to own (an empty) target directory.
mmdebstrap --variant=minbase --include="$include" \
	--aptopt='Acquire::Retries "3"' \
	--customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
	"$suite" "$tmp/rootfs"

echo "build-default-image: [3/4] trimming apt caches and lists; the sandbox's host name and hosts"
rm -rf "$tmp/rootfs/var/cache/apt/"* "$tmp/rootfs/var/lib/apt/lists/"* "$tmp/rootfs/var/log/apt/"*
mkdir -p "$tmp/rootfs/var/lib/apt/lists/partial"
# mmdebstrap copies the build host's name into /etc/hostname: a sandbox gets a fixed one.
"$here/image-identity.sh" "$tmp/rootfs"

echo "build-default-image: [4/4] installing into $out"
if [ "$kind" = default ]; then
	printf 'mmdebstrap %s minbase include=%s built %s\n' "$suite" "$include" "$(date -u +%FT%TZ)" >"$tmp/rootfs/$stamp"
else
	printf 'mmdebstrap %s minbase include=%s (%s) built %s\n' "$suite" "$include" "$kind" "$(date -u +%FT%TZ)" >"$tmp/rootfs/$stamp"
fi
mv -T "$tmp/rootfs" "$out"
size=$(du -sh "$out" | cut -f1)
files=$(find "$out" -xdev | wc -l)
echo "build-default-image: done in $((SECONDS - start)) s: $out, $size, $files files"
