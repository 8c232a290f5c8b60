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
# Trust: apt verifies sid's InRelease with /usr/share/keyrings/debian-archive-keyring.gpg
# (signed-by). Sid is signed by the "12/bookworm" and "13/trixie" automatic archive keys, both in
# bookworm's debian-archive-keyring; the .debs are then checked against the signed hashes.
# Acquire::Check-Valid-Until is off, as in this machine's own apt configuration: the mirror may
# serve a frozen snapshot whose Valid-Until has passed. The signature is still required.
#
# Environment: CRIU_DEBIAN_MIRROR overrides the mirror read from /etc/apt/sources.list(.d).
set -euo pipefail

MIN_VERSION=4.2.1
ARCH=amd64
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

die() { echo "criu.sh: $*" >&2; exit 1; }

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
[ "$(dpkg --print-architecture)" = "$ARCH" ] || die "only $ARCH is supported"
[ "$(id -u)" -eq 0 ] || die "run as root: 'criu check' needs root to verify the install"
for tool in apt-get apt-cache dpkg-deb flock; do
	command -v "$tool" >/dev/null || die "$tool is missing"
done
[ -r "$KEYRING" ] || die "$KEYRING is missing (apt-get install debian-archive-keyring)"

# One installer at a time per prefix (make -j, parallel CI jobs).
exec 9>"$PREFIX.lock"
flock 9
if [ -f "$STAMP" ] && [ -x "$WRAPPER" ]; then
	echo "criu.sh: $(cat "$STAMP") in $PREFIX (installed by a concurrent run)" >&2
	exit 0
fi

# debian_mirror prints the first Debian archive URI configured for a bookworm suite.
debian_mirror() {
	local f
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[ -r "$f" ] || continue
		# deb [options] URI suite components...
		awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
			if ($(i+1) == "bookworm") { print $i; exit } }' "$f"
	done
	for f in /etc/apt/sources.list.d/*.sources; do
		[ -r "$f" ] || continue
		# deb822 stanzas, separated by blank lines.
		awk 'BEGIN { RS = ""; FS = "\n" }
			{ uri = ""; ok = 0; deb = 0
			  for (j = 1; j <= NF; j++) {
				if ($j ~ /^URIs:/) { split($j, a, /[ \t]+/); uri = a[2] }
				if ($j ~ /^Suites:/ && $j ~ /[ \t]bookworm([ \t]|$)/) ok = 1
				if ($j ~ /^Types:/ && $j ~ /[ \t]deb([ \t]|$)/) deb = 1 }
			  if (ok && deb && uri != "") { print uri; exit } }' "$f"
	done
}
MIRROR=${CRIU_DEBIAN_MIRROR:-$(debian_mirror | head -n 1)}
[ -n "$MIRROR" ] || die "no Debian mirror for bookworm in /etc/apt/sources.list(.d); set CRIU_DEBIAN_MIRROR"
MIRROR=${MIRROR%/}

start=$(date +%s.%N)
work=$(mktemp -d "$PREFIX.work.XXXXXX")
trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"
mkdir -p "$work"/{etc/parts,etc/sourceparts,etc/prefparts,etc/trustedparts,lists/partial,cache/archives/partial,log,debs,root}
: >"$work/status"
echo "deb [arch=$ARCH signed-by=$KEYRING] $MIRROR sid main" >"$work/etc/sources.list"
# A complete private configuration: APT_CONFIG is read first and points every Dir:: at $work, so
# neither /etc/apt/apt.conf.d (hooks such as appstream's Post-Invoke) nor the system's lists,
# cache, status or lock are used.
cat >"$work/apt.conf" <<EOF
Dir::Etc::Main "/dev/null";
Dir::Etc::Parts "$work/etc/parts";
Dir::Etc::SourceList "$work/etc/sources.list";
Dir::Etc::SourceParts "$work/etc/sourceparts";
Dir::Etc::Preferences "/dev/null";
Dir::Etc::PreferencesParts "$work/etc/prefparts";
Dir::Etc::Trusted "/dev/null";
Dir::Etc::TrustedParts "$work/etc/trustedparts";
Dir::State "$work";
Dir::State::Lists "$work/lists";
Dir::State::status "$work/status";
Dir::Cache "$work/cache";
Dir::Log "$work/log";
Debug::NoLocking "true";
APT::Architecture "$ARCH";
APT::Architectures { "$ARCH"; };
Acquire::Languages "none";
Acquire::Check-Valid-Until "false";
EOF
export APT_CONFIG=$work/apt.conf
# apt drops to _apt to download; let it write there.
if id _apt >/dev/null 2>&1; then chown -R _apt "$work/debs" "$work/lists/partial" "$work/cache/archives/partial"; fi

echo "criu.sh: fetching sid's package list from $MIRROR" >&2
apt-get -q update >"$work/log/update.log" 2>&1 || { cat "$work/log/update.log" >&2; die "apt-get update of sid failed"; }
# A Release file that fails verification is only a warning to apt-get update, and apt then keeps
# no InRelease in the lists: insist on a verified one.
if grep -qE '^(W|E): .*(GPG error|NO_PUBKEY|not signed|EXPKEYSIG|BADSIG|REVKEYSIG)' "$work/log/update.log" ||
	! compgen -G "$work/lists/*_dists_sid_InRelease" >/dev/null; then
	cat "$work/log/update.log" >&2
	die "sid's Release file could not be verified with $KEYRING"
fi

version=$(apt-cache show --no-all-versions criu 2>/dev/null | awk '/^Version:/ { print $2; exit }')
[ -n "$version" ] || die "sid has no criu package"
upstream=${version#*:}
upstream=${upstream%%-*}
dpkg --compare-versions "$upstream" ge "$MIN_VERSION" ||
	die "sid's criu is $version, older than $MIN_VERSION; refusing (older CRIU fails on this kernel)"

# The run-time closure: criu and everything it Depends on, recursively.
mapfile -t pkgs < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
	--no-breaks --no-replaces --no-enhances criu | grep -v '^ ' | grep -v '^<' | sort -u)
echo "criu.sh: downloading criu $version and ${#pkgs[@]} packages: ${pkgs[*]}" >&2
(cd "$work/debs" && apt-get -q download "${pkgs[@]}" >"$work/log/download.log" 2>&1) ||
	{ cat "$work/log/download.log" >&2; die "apt-get download failed"; }

root=$work/root
for deb in "$work"/debs/*.deb; do
	dpkg-deb -x "$deb" "$root"
done
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
