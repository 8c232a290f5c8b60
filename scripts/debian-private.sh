# debian-private.sh is sourced by scripts that install a Debian package newer than bookworm's
# (criu.sh: sid's criu; postgres.sh: trixie's PostgreSQL 17) into a private prefix, without
# touching the system's apt state or installed packages.
#
#   private_apt_init SUITE WORK   private apt configuration and verified package lists in WORK
#   private_closure PKG...        PKG and everything it Depends on, recursively (one per line)
#   private_unpack WORK ROOT PKG... downloads PKGs and unpacks them into ROOT with dpkg-deb -x
#
# Trust: apt verifies the suite's InRelease with /usr/share/keyrings/debian-archive-keyring.gpg
# (signed-by). Sid and trixie are signed by the "12/bookworm" and "13/trixie" automatic archive
# keys, both in bookworm's debian-archive-keyring; the .debs are then checked against the signed
# hashes. Acquire::Check-Valid-Until is off, as in this machine's own apt configuration: the
# mirror may serve a frozen snapshot whose Valid-Until has passed. The signature is still
# required.
#
# Environment: DELTAGYM_DEBIAN_MIRROR (or CRIU_DEBIAN_MIRROR) overrides the
# mirror read from /etc/apt/sources.list(.d). The caller defines die().

PRIVATE_ARCH=amd64
PRIVATE_KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

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

# private_apt_init SUITE WORK: checks the machine, then writes a complete private apt
# configuration in WORK (exported as APT_CONFIG) and fetches SUITE's verified package lists.
private_apt_init() {
	local suite=$1 work=$2 mirror tool
	[ "$(dpkg --print-architecture)" = "$PRIVATE_ARCH" ] || die "only $PRIVATE_ARCH is supported"
	for tool in apt-get apt-cache dpkg-deb flock; do
		command -v "$tool" >/dev/null || die "$tool is missing"
	done
	[ -r "$PRIVATE_KEYRING" ] || die "$PRIVATE_KEYRING is missing (apt-get install debian-archive-keyring)"
	# sed, not head: head leaving early would kill debian_mirror with SIGPIPE (pipefail).
	mirror=${DELTAGYM_DEBIAN_MIRROR:-${CRIU_DEBIAN_MIRROR:-$(debian_mirror | sed -n 1p)}}
	[ -n "$mirror" ] || die "no Debian mirror for bookworm in /etc/apt/sources.list(.d); set DELTAGYM_DEBIAN_MIRROR"
	mirror=${mirror%/}

	chmod 0755 "$work"
	mkdir -p "$work"/{etc/parts,etc/sourceparts,etc/prefparts,etc/trustedparts,lists/partial,cache/archives/partial,log,debs}
	: >"$work/status"
	echo "deb [arch=$PRIVATE_ARCH signed-by=$PRIVATE_KEYRING] $mirror $suite main" >"$work/etc/sources.list"
	# A complete private configuration: APT_CONFIG is read first and points every Dir:: at
	# $work, so neither /etc/apt/apt.conf.d (hooks such as appstream's Post-Invoke) nor the
	# system's lists, cache, status or lock are used.
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
APT::Architecture "$PRIVATE_ARCH";
APT::Architectures { "$PRIVATE_ARCH"; };
Acquire::Languages "none";
Acquire::Check-Valid-Until "false";
EOF
	export APT_CONFIG=$work/apt.conf
	# apt drops to _apt to download; let it write there.
	if [ "$(id -u)" -eq 0 ] && id _apt >/dev/null 2>&1; then chown -R _apt "$work/debs" "$work/lists/partial" "$work/cache/archives/partial"; fi

	echo "${0##*/}: fetching $suite's package list from $mirror" >&2
	apt-get -q update >"$work/log/update.log" 2>&1 || { cat "$work/log/update.log" >&2; die "apt-get update of $suite failed"; }
	# A Release file that fails verification is only a warning to apt-get update, and apt then
	# keeps no InRelease in the lists: insist on a verified one.
	if grep -qE '^(W|E): .*(GPG error|NO_PUBKEY|not signed|EXPKEYSIG|BADSIG|REVKEYSIG)' "$work/log/update.log" ||
		! compgen -G "$work/lists/*_dists_${suite}_InRelease" >/dev/null; then
		cat "$work/log/update.log" >&2
		die "$suite's Release file could not be verified with $PRIVATE_KEYRING"
	fi
}

# private_closure PKG...: the packages and everything they Depend on, recursively.
private_closure() {
	apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
		--no-breaks --no-replaces --no-enhances "$@" | grep -v '^ ' | grep -v '^<' | sort -u
}

# private_unpack WORK ROOT PKG...: downloads the packages (checked against the signed lists)
# and unpacks each into ROOT.
private_unpack() {
	local work=$1 root=$2 deb
	shift 2
	(cd "$work/debs" && apt-get -q download "$@" >"$work/log/download.log" 2>&1) ||
		{ cat "$work/log/download.log" >&2; die "apt-get download failed"; }
	mkdir -p "$root"
	for deb in "$work"/debs/*.deb; do
		dpkg-deb -x "$deb" "$root"
	done
}
