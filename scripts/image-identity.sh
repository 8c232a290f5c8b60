#!/usr/bin/env bash
# image-identity.sh ROOTFS gives a root filesystem the identity of a sandbox rather than that
# of the machine that built it: /etc/hostname holds "sandbox" (the runtime's default host name),
# and /etc/hosts, when the build left none, the localhost entries. build-default-image.sh runs
# it on every build. Files are replaced, never written through: a symbolic link at either path
# is removed, not followed.
set -euo pipefail

if [ $# -ne 1 ] || [ ! -d "$1/etc" ]; then
	echo "usage: $0 ROOTFS (a root filesystem with an etc directory)" >&2
	exit 2
fi
etc=$1/etc

rm -f "$etc/hostname"
printf 'sandbox\n' >"$etc/hostname"
if [ -L "$etc/hosts" ] || [ ! -e "$etc/hosts" ]; then
	rm -f "$etc/hosts"
	printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n' >"$etc/hosts"
fi
