#!/usr/bin/env bash
# criu.sh installs CRIU >= 4.2.1 from Debian sid into a private prefix, without touching the
# system's apt state or installed packages.
#
#   scripts/criu.sh PREFIX
#
# Debian 12's criu 3.17 fails on this kernel (vDSO) and trixie's 4.1 cannot dump INET sockets on
# Linux >= 6.16, so only sid's criu (>= 4.2.1) is accepted; there is no fallback. Its binary needs
# glibc >= 2.38 and libnet9/libnl-3 >= 3.11, which bookworm lacks, so the whole run-time closure
# (criu, libcompel1, libc6 and every library they depend on, resolved with apt-cache against a
# private copy of sid's package lists) is unpacked with dpkg-deb -x into PREFIX, and PREFIX/bin/criu
# runs the binary through the prefix's own dynamic loader with --library-path, so nothing leaks
# into programs criu starts (ip, iptables-restore use the system's libraries).
#
# Layout:
#   PREFIX/bin/criu                         wrapper to call (also for go-criu's swrk)
#   PREFIX/usr/sbin/criu                    the real binary
#   PREFIX/usr/lib/x86_64-linux-gnu/        sid's ld-linux-x86-64.so.2, libc.so.6, libcompel.so.1, ...
#   PREFIX/.stamp                           "criu <debian version>"; present = installed and checked
#
# Trust and the mirror: scripts/debian-private.sh.
set -euo pipefail

MIN_VERSION=4.2.1

die() { echo "criu.sh: $*" >&2; exit 1; }
# shellcheck source=scripts/debian-private.sh
. "$(dirname "${BASH_SOURCE[0]}")/debian-private.sh"

[ $# -eq 1 ] || die "usage: scripts/criu.sh PREFIX"
mkdir -p "$1"
PREFIX=$(cd "$1" && pwd -P)
STAMP=$PREFIX/.stamp
WRAPPER=$PREFIX/bin/criu
LIBDIR=$PREFIX/usr/lib/x86_64-linux-gnu

# Fast path: installed and checked before.
if [ -f "$STAMP" ] && [ -x "$WRAPPER" ]; then
	echo "criu.sh: $(cat "$STAMP") in $PREFIX (cached)" >&2
	exit 0
fi

# PREFIX is emptied on install: refuse a directory holding anything but this script's files.
for entry in "$PREFIX"/* "$PREFIX"/.[!.]*; do
	[ -e "$entry" ] || continue
	case "${entry##*/}" in
	bin | usr | .stamp) ;;
	*) die "$PREFIX holds ${entry##*/}, which this script did not write; use an empty or dedicated directory" ;;
	esac
done
[ "$(id -u)" -eq 0 ] || die "run as root: 'criu check' needs root to verify the install"

# One installer at a time per prefix (make -j, parallel CI jobs).
exec 9>"$PREFIX.lock"
flock 9
if [ -f "$STAMP" ] && [ -x "$WRAPPER" ]; then
	echo "criu.sh: $(cat "$STAMP") in $PREFIX (installed by a concurrent run)" >&2
	exit 0
fi

start=$(date +%s.%N)
work=$(mktemp -d "$PREFIX.work.XXXXXX")
trap 'rm -rf "$work"' EXIT
private_apt_init sid "$work"

version=$(apt-cache show --no-all-versions criu 2>/dev/null | awk '/^Version:/ { print $2; exit }' || true)
[ -n "$version" ] || die "sid has no criu package"
upstream=${version#*:}
upstream=${upstream%%-*}
dpkg --compare-versions "$upstream" ge "$MIN_VERSION" ||
	die "sid's criu is $version, older than $MIN_VERSION; refusing (older CRIU fails on this kernel)"

# The run-time closure: criu and everything it Depends on, recursively.
mapfile -t pkgs < <(private_closure criu)
echo "criu.sh: downloading criu $version and ${#pkgs[@]} packages: ${pkgs[*]}" >&2
root=$work/root
private_unpack "$work" "$root" "${pkgs[@]}"
loader=$root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2
[ -x "$root/usr/sbin/criu" ] && [ -e "$loader" ] || die "criu or its loader missing after unpacking"

# Every shared library must resolve inside the prefix (a bookworm library would be too old).
if "$loader" --library-path "$root/usr/lib/x86_64-linux-gnu" --list "$root/usr/sbin/criu" |
	awk -v root="$root/" '/=>/ && !/linux-vdso/ && index($3, root) != 1 { print; bad = 1 } END { exit !bad }' >&2; then
	die "criu's libraries do not all resolve inside the prefix (above)"
fi

# Swap the new tree into PREFIX, keeping only what the wrapper needs.
rm -rf "$PREFIX/usr" "$PREFIX/etc" "$PREFIX/bin"
mv "$root/usr" "$PREFIX/usr"
mkdir -p "$PREFIX/bin"
cat >"$WRAPPER.tmp" <<EOF
#!/bin/sh
# Runs Debian sid's criu $version with its own loader and libraries (written by scripts/criu.sh).
exec "$LIBDIR/ld-linux-x86-64.so.2" --library-path "$LIBDIR" "$PREFIX/usr/sbin/criu" "\$@"
EOF
chmod 0755 "$WRAPPER.tmp"
mv "$WRAPPER.tmp" "$WRAPPER"

if ! out=$("$WRAPPER" check 2>&1); then
	echo "$out" >&2
	die "'criu check' failed with criu $version (above); not marking $PREFIX as installed"
fi
echo "$out" | grep -q "Looks good" || { echo "$out" >&2; die "'criu check' did not say 'Looks good'"; }
"$WRAPPER" --version >&2
printf 'criu %s\n' "$version" >"$STAMP"
end=$(date +%s.%N)
echo "criu.sh: criu $version installed in $PREFIX in $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }') s" >&2
