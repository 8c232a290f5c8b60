#!/usr/bin/env bash
# postgres.sh installs PostgreSQL 17 from Debian trixie into a private prefix, for the private
# cluster that the ledger's tests and `make run` start (server/ledger/pgserver).
#
#   scripts/postgres.sh PREFIX
#
# Why not bookworm's PostgreSQL 15: 16 and later extend a table many pages at a time
# (fallocate), where 15 writes one zeroed page per 8 KiB through the page cache, and with 4 KiB
# step rows the ledger writer delivers more steps/s on 17 (docs/PERFORMANCE.md, "The ledger":
# PostgreSQL 17 against 15, with the command). Trixie is a stable release, so the major version
# stays 17 for its lifetime (a cluster cannot be opened by another major version). The install
# is the trixie package of the day it ran; delete PREFIX to take a newer one (trixie's point and
# security updates).
#
# Trixie's binaries need glibc 2.41, which bookworm lacks, so the package's run-time closure
# (postgresql-17 and the libraries it depends on, resolved with apt-cache against a private copy
# of trixie's package lists, without perl, systemd and the JIT's LLVM) is unpacked with
# dpkg-deb -x into PREFIX, and each executable is patched (patchelf) to run with the prefix's own
# dynamic loader and to find its libraries there (DT_RPATH, which also covers the modules
# postgres loads). JIT compilation is unavailable: llvmjit.so is left out.
#
# Layout:
#   PREFIX/bin -> usr/lib/postgresql/17/bin  initdb, postgres, pg_ctl, ... (patched)
#   PREFIX/usr/share/postgresql/17           what initdb needs (found relative to the binaries)
#   PREFIX/usr/lib/x86_64-linux-gnu/         trixie's ld-linux-x86-64.so.2, libc.so.6, libicu, ...
#   PREFIX/.stamp                            "postgresql-17 <debian version>"; present = installed
#
# Trust and the mirror: scripts/debian-private.sh. Needs patchelf (scripts/deps.sh postgres).
set -euo pipefail

MAJOR=17
SUITE=trixie

die() { echo "postgres.sh: $*" >&2; exit 1; }
# shellcheck source=scripts/debian-private.sh
. "$(dirname "${BASH_SOURCE[0]}")/debian-private.sh"

[ $# -eq 1 ] || die "usage: scripts/postgres.sh PREFIX"
case "$1" in *[[:space:]]*) die "PREFIX '$1' has white space, which the library check cannot take" ;; esac
mkdir -p "$1"
PREFIX=$(cd "$1" && pwd -P)
STAMP=$PREFIX/.stamp
BINDIR=$PREFIX/usr/lib/postgresql/$MAJOR/bin
LIBDIR=$PREFIX/usr/lib/x86_64-linux-gnu

# installed: stamped, and the binaries still run (they name the prefix's loader by absolute
# path, so a moved checkout needs a new install).
installed() { [ -f "$STAMP" ] && "$PREFIX/bin/postgres" -V >/dev/null 2>&1; }

# Fast path: installed and checked before.
if installed; then
	echo "postgres.sh: $(cat "$STAMP") in $PREFIX (cached)" >&2
	exit 0
fi

# PREFIX is emptied on install: refuse a directory holding anything but this script's files.
for entry in "$PREFIX"/* "$PREFIX"/.[!.]*; do
	[ -e "$entry" ] || [ -L "$entry" ] || continue
	case "${entry##*/}" in
	bin | usr | .stamp) ;;
	*) die "$PREFIX holds ${entry##*/}, which this script did not write; use an empty or dedicated directory" ;;
	esac
done
command -v patchelf >/dev/null || die "patchelf is missing (scripts/deps.sh postgres installs it)"

# One installer at a time per prefix (make -j, parallel CI jobs).
exec 9>"$PREFIX.lock"
flock 9
if installed; then
	echo "postgres.sh: $(cat "$STAMP") in $PREFIX (installed by a concurrent run)" >&2
	exit 0
fi
rm -f "$STAMP"

start=$(date +%s.%N)
work=$(mktemp -d "$PREFIX.work.XXXXXX")
trap 'rm -rf "$work"' EXIT
private_apt_init "$SUITE" "$work"

version=$(apt-cache show --no-all-versions "postgresql-$MAJOR" 2>/dev/null | awk '/^Version:/ { print $2; exit }' || true)
[ -n "$version" ] || die "$SUITE has no postgresql-$MAJOR package"

# The server's closure: the package and the libraries it depends on, recursively. The rest of
# the closure (postgresql-common's perl and its scripts, systemd, locales, tzdata: the system's
# zoneinfo serves) is not needed to run initdb and postgres; LLVM and Z3 only serve the JIT.
mapfile -t pkgs < <(private_closure "postgresql-$MAJOR" |
	grep -E "^(postgresql-$MAJOR|lib.*|zlib1g)\$" | grep -vE '^(libllvm|libz3-|libperl|libpam-modules)|-perl$')
echo "postgres.sh: downloading postgresql-$MAJOR $version and ${#pkgs[@]} packages: ${pkgs[*]}" >&2
root=$work/root
private_unpack "$work" "$root" "${pkgs[@]}"
rbin=$root/usr/lib/postgresql/$MAJOR/bin
rlib=$root/usr/lib/x86_64-linux-gnu
[ -x "$rbin/postgres" ] && [ -x "$rbin/initdb" ] && [ -e "$rlib/ld-linux-x86-64.so.2" ] ||
	die "postgres, initdb or the loader missing after unpacking"
rm -f "$root/usr/lib/postgresql/$MAJOR/lib/llvmjit"*.so
rm -rf "$root/usr/lib/postgresql/$MAJOR/lib/bitcode"

# Point each executable at the prefix's loader and libraries, as they will be once moved.
for f in "$rbin"/*; do
	[ -f "$f" ] && [ ! -L "$f" ] || continue
	head -c 4 "$f" | grep -q ELF || continue
	patchelf --set-interpreter "$LIBDIR/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$LIBDIR" "$f"
done

# Swap the new tree into PREFIX. From here on, a failure removes it: internal/locate only takes a
# stamped install, and the next run starts over.
trap 'rm -rf "$work"; [ -f "$STAMP" ] || rm -rf "$PREFIX/usr" "$PREFIX/bin"' EXIT
rm -rf "$PREFIX/usr" "$PREFIX/bin"
mv "$root/usr" "$PREFIX/usr"
ln -s "usr/lib/postgresql/$MAJOR/bin" "$PREFIX/bin"

# Every shared library of the server and its modules must resolve inside the prefix (a
# bookworm library would be too old): the executables through their own interpreter and DT_RPATH,
# the modules as postgres loads them.
check_libs() {
	local f=$1 out
	shift
	if ! out=$("$@" 2>&1) ||
		echo "$out" | awk -v p="$PREFIX/" '/not found/ || (/=>/ && !/linux-vdso/ && index($3, p) != 1) { bad = 1 } END { exit !bad }'; then
		echo "$f:" >&2
		echo "$out" >&2
		die "a library of $f does not resolve inside the prefix (above)"
	fi
}
for f in "$BINDIR/postgres" "$BINDIR/initdb"; do
	check_libs "$f" env LD_TRACE_LOADED_OBJECTS=1 "$f"
done
for f in "$PREFIX/usr/lib/postgresql/$MAJOR/lib"/*.so; do
	check_libs "$f" "$LIBDIR/ld-linux-x86-64.so.2" --library-path "$LIBDIR" --list "$f"
done
got=$("$PREFIX/bin/postgres" -V) || die "$PREFIX/bin/postgres does not run"
case "$got" in
"postgres (PostgreSQL) $MAJOR."*) ;;
*) die "$PREFIX/bin/postgres says '$got', not PostgreSQL $MAJOR" ;;
esac
"$PREFIX/bin/initdb" -V >/dev/null || die "$PREFIX/bin/initdb does not run"
echo "postgres.sh: $got" >&2
printf 'postgresql-%s %s\n' "$MAJOR" "$version" >"$STAMP"
end=$(date +%s.%N)
echo "postgres.sh: postgresql-$MAJOR $version installed in $PREFIX in $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }') s" >&2
