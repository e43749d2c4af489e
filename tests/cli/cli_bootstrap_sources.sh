#!/usr/bin/env bash
# cli_bootstrap_sources — what the bootstrap fetches comes through the package clients as the
# machine configures them (issue #38 item 11): no host name is written into the build and setup
# files (a user's apt mirror, proxy or offline repository must apply), and Debian trixie's
# Vulkan/SPIR-V header packages come through apt itself, from an empty cache, into a private
# directory, sha256-checked.  Skips (77) where apt has no Debian main source configured.
# Environment (from tests/CMakeLists.txt): KVT_SOURCE_DIR.
set -u
. "$(dirname "$0")/lib.sh"
SRC=${KVT_SOURCE_DIR:?KVT_SOURCE_DIR is not set}
t_init cli-bootstrap-sources
trap 'rm -rf "$TMP"' EXIT

# 1. no host: URLs in the files that install or build anything (loopback and example names aside)
hosts=$(cd "$SRC" && git ls-files 'scripts/*' 'cmake/*' 'Makefile' 'CMakeLists.txt' '*/CMakeLists.txt' '.ci/*' 'bench/*.sh' 2>/dev/null |
    xargs grep -nE 'https?://[A-Za-z0-9.-]+' 2>/dev/null | grep -vE 'https?://(localhost|127\.0\.0\.1|\[::1\]|[a-z0-9.-]*example(\.[a-z]+)?)([:/"'"'"' ]|$)')
[ -z "$hosts" ] && ok "no host name in the setup and build files" || bad "host names in the setup files: $hosts"

# 2. the Vulkan headers through apt, from an empty cache
if ! grep -rqs '^[^#]*\(deb\|URIs:\).*debian' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "skip: apt has no Debian source configured"
    t_finish
    exit 77
fi
if KVTIER_CACHE=$TMP/cache "$SRC/scripts/bootstrap.sh" vulkan-headers >"$TMP/out" 2>&1; then
    [ -f "$TMP/cache/vulkan-headers-1.4.309/usr/include/vulkan/vulkan.hpp" ] &&
        [ -f "$TMP/cache/vulkan-headers-1.4.309/usr/include/spirv/unified1/spirv.hpp" ] &&
        ok "Vulkan and SPIR-V headers fetched through apt into an empty cache, sha256-checked" ||
        bad "vulkan-headers: no headers in $TMP/cache: $(ls -R "$TMP/cache" | head)"
    grep -q "through apt from the configured mirror" "$TMP/out" && ok "the bootstrap says where they came from" ||
        bad "vulkan-headers said: $(cat "$TMP/out")"
else
    bad "bootstrap.sh vulkan-headers from an empty cache: $(tail -5 "$TMP/out")"
fi
# the system's apt state is not touched: no trixie list in apt's own directory
ls /var/lib/apt/lists 2>/dev/null | grep -q trixie && bad "a trixie list was left in /var/lib/apt/lists" ||
    ok "apt's own lists hold no trixie index (a private state directory was used)"
# a second run: cached, no network
KVTIER_CACHE=$TMP/cache "$SRC/scripts/bootstrap.sh" vulkan-headers >"$TMP/out2" 2>&1 && ! grep -q fetching "$TMP/out2" &&
    ok "a second run uses the cache" || bad "second run: $(cat "$TMP/out2")"
t_finish
