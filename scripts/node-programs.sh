#!/usr/bin/env bash
# node-programs.sh OUT CRIU_PREFIX PG_PREFIX copies the private installs of CRIU (scripts/criu.sh)
# and PostgreSQL 17 (scripts/postgres.sh) into OUT, relocated for the node image, which holds OUT
# at /opt/deltagym (make node-image, docs/NODE-IMAGE.md):
#
#   OUT/criu/bin/criu        the wrapper, rewritten to run /opt/deltagym/criu's loader and libraries
#   OUT/criu/usr/...         the prefix as criu.sh installed it (the same relative layout)
#   OUT/postgres/bin         -> usr/lib/postgresql/17/bin, whose executables are patched again
#                            (patchelf) to name /opt/deltagym/postgres's loader and DT_RPATH
#   OUT/postgres/usr/...     the prefix as postgres.sh installed it
#   OUT/.stamp               the two prefixes' stamps: what OUT was made from
#
# Both prefixes name their absolute path: criu's wrapper in its exec line, postgres's executables
# in their ELF interpreter and DT_RPATH (an interpreter cannot be relative). Nothing else in
# them does, which the copy checks: no file of OUT may still name either prefix. Their binaries
# only run at their new path, so they are run there by the node image's test
# (scripts/ocilayout, TestNodeImage). A second run with the same prefixes does nothing; OUT is
# built beside itself and renamed into place. Needs patchelf (scripts/deps.sh postgres).
set -euo pipefail

IMAGE_DIR=/opt/deltagym
MAJOR=17

die() { echo "node-programs.sh: $*" >&2; exit 1; }

[ $# -eq 3 ] || die "usage: scripts/node-programs.sh OUT CRIU_PREFIX PG_PREFIX"
out=$1
criu=$(cd "$2" 2>/dev/null && pwd -P) || die "no CRIU prefix at $2 (make criu)"
pg=$(cd "$3" 2>/dev/null && pwd -P) || die "no PostgreSQL prefix at $3 (make postgres)"
[ -f "$criu/.stamp" ] && [ -x "$criu/bin/criu" ] || die "$criu is not an installed CRIU prefix (make criu)"
[ -f "$pg/.stamp" ] && [ -x "$pg/bin/postgres" ] || die "$pg is not an installed PostgreSQL prefix (make postgres)"
command -v patchelf >/dev/null || die "patchelf is missing (scripts/deps.sh postgres installs it)"

want=$(cat "$criu/.stamp" "$pg/.stamp")
if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$want" ]; then
	echo "node-programs.sh: $out holds $(echo "$want" | paste -sd, -) (cached)" >&2
	exit 0
fi

parent=$(dirname "$out")
mkdir -p "$parent"
tmp=$(mktemp -d "$parent/.node-programs.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
chmod 0755 "$tmp"

cp -a "$criu" "$tmp/criu"
lib=$IMAGE_DIR/criu/usr/lib/x86_64-linux-gnu
cat >"$tmp/criu/bin/criu" <<EOF
#!/bin/sh
# Runs Debian sid's $(cat "$criu/.stamp") with its own loader and libraries (written by
# scripts/node-programs.sh from scripts/criu.sh's install, for the node image).
exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$IMAGE_DIR/criu/usr/sbin/criu" "\$@"
EOF
chmod 0755 "$tmp/criu/bin/criu"

cp -a "$pg" "$tmp/postgres"
lib=$IMAGE_DIR/postgres/usr/lib/x86_64-linux-gnu
for f in "$tmp/postgres/usr/lib/postgresql/$MAJOR/bin"/*; do
	[ -f "$f" ] && [ ! -L "$f" ] || continue
	head -c 4 "$f" | grep -q ELF || continue
	patchelf --set-interpreter "$lib/ld-linux-x86-64.so.2" --force-rpath --set-rpath "$lib" "$f"
done
chmod 0755 "$tmp/criu" "$tmp/postgres"

if left=$(grep -rlF -e "$criu" -e "$pg" "$tmp"); then
	echo "$left" >&2
	die "the files above still name the build host's prefixes"
fi
printf '%s\n' "$want" >"$tmp/.stamp"
rm -rf "$out"
mv -T "$tmp" "$out"
echo "node-programs.sh: $out holds $(echo "$want" | paste -sd, -), relocated for $IMAGE_DIR" >&2
