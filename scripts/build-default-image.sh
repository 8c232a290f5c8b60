#!/usr/bin/env bash
# build-default-image.sh OUT_DIR [KIND] builds a root filesystem made by Debian's mmdebstrap
# from Debian bookworm minbase, with its own host name and localhost entries in /etc/hosts
# (image-identity.sh), never the build host's. KIND names the package set:
#   default   (the default) the sandbox image `make run` uses: bash, coreutils, procps, python3,
#             git and ca-certificates; host name "sandbox";
#   services  the default's packages with Debian's postgresql-15 (the cluster 15/main its
#             package creates, with the default configuration), redis-server and nodejs, for
#             the service rows of the process-shape tests (make image-services);
#   node      the Debian root of a deltagym node's container image (make node-image,
#             docs/NODE-IMAGE.md): what the server and the programs it runs need at run time
#             and no more: ca-certificates; iproute2 and iptables, which CRIU runs; tzdata, the
#             zoneinfo of the private PostgreSQL; procps for whoever debugs the node. It has
#             the system user postgres (uid and gid 999, fixed so that a cluster kept on the
#             node's disk stays its own across builds of the image), which the private
#             PostgreSQL runs as, the host name "deltagym-node" and an empty /etc/resolv.conf
#             (the container runtime provides its own); no manuals, translations or docs but
#             the copyright files.
# It builds into a temp dir beside OUT_DIR and renames it into place, so OUT_DIR is either
# complete (with a stamp file) or absent. A second run with the same OUT_DIR does nothing.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
	echo "usage: $0 OUT_DIR [default|services|node]" >&2
	exit 2
fi
out=$1
kind=${2:-default}
stamp=.deltagym-image-stamp
suite=bookworm
sandbox=bash,coreutils,procps,python3,git,ca-certificates
hostname=sandbox
dpkgopts=()
NODE_POSTGRES_ID=999
case "$kind" in
default) include=$sandbox ;;
services) include=$sandbox,postgresql-15,redis-server,nodejs ;;
node)
	include=ca-certificates,iproute2,iptables,procps,tzdata
	hostname=deltagym-node
	# As Debian's slim container images: no manuals, translations or docs but the copyrights.
	dpkgopts=(
		--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
		--dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*'
		--dpkgopt='path-include=/usr/share/doc/*/copyright'
	)
	;;
*)
	echo "usage: $0 OUT_DIR [default|services|node]: unknown image kind $kind" >&2
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
	--aptopt='Acquire::Retries "3"' "${dpkgopts[@]}" \
	--customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
	"$suite" "$tmp/rootfs"

echo "build-default-image: [3/4] trimming apt caches and lists; the image's host name and hosts"
rm -rf "$tmp/rootfs/var/cache/apt/"* "$tmp/rootfs/var/lib/apt/lists/"* "$tmp/rootfs/var/log/apt/"*
mkdir -p "$tmp/rootfs/var/lib/apt/lists/partial"
# mmdebstrap copies the build host's name into /etc/hostname: an image gets a fixed one.
"$here/image-identity.sh" "$tmp/rootfs" "$hostname"
if [ "$kind" = node ]; then
	# The build host's resolver is no business of the node's.
	: >"$tmp/rootfs/etc/resolv.conf"
	chroot "$tmp/rootfs" groupadd --system --gid "$NODE_POSTGRES_ID" postgres
	chroot "$tmp/rootfs" useradd --system --uid "$NODE_POSTGRES_ID" --gid postgres \
		--home-dir /var/lib/postgresql --no-create-home --shell /usr/sbin/nologin postgres
fi

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
