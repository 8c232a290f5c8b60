#!/usr/bin/env bash
# image-identity.sh ROOTFS [HOSTNAME] gives a root filesystem the identity of a sandbox (or of
# what HOSTNAME names) rather than that of the machine that built it: /etc/hostname holds
# HOSTNAME, by default "sandbox" (the runtime's default host name), and /etc/hosts, when the
# build left none, the localhost entries. build-default-image.sh runs it on every build. Files
# are replaced, never written through: a symbolic link at either path is removed, not followed.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ] || [ ! -d "$1/etc" ]; then
	echo "usage: $0 ROOTFS [HOSTNAME] (a root filesystem with an etc directory)" >&2
	exit 2
fi
etc=$1/etc
name=${2:-sandbox}

rm -f "$etc/hostname"
printf '%s\n' "$name" >"$etc/hostname"
if [ -L "$etc/hosts" ] || [ ! -e "$etc/hosts" ]; then
	rm -f "$etc/hosts"
	printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n' >"$etc/hosts"
fi
