#!/usr/bin/env bash
# deps.sh installs the Debian packages deltagym needs, idempotently.
# Each caller names the groups it needs: base (always), postgres, image, browser.
# A package already installed is never touched, so on a warm machine it costs one dpkg-query
# per package.
set -euo pipefail

need=(gcc make libc6-dev)
for group in "$@"; do
	case "$group" in
	base) ;;
	postgres) need+=(postgresql patchelf) ;;
	image) need+=(busybox-static mmdebstrap) ;;
	browser) need+=(chromium) ;; # the web view's browser test (server/webui)
	*) echo "deps.sh: unknown group $group" >&2; exit 2 ;;
	esac
done

missing=()
for p in "${need[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
	echo "deps.sh: missing Debian packages: ${missing[*]}; run as root (or install them) and retry" >&2
	exit 1
fi
echo "deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# An old package list can name versions the mirror no longer has: refresh once on failure.
apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 ||
	{ apt-get update -q >&2 && apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; }
