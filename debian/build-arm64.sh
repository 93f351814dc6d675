#!/bin/sh
# The arm64 .deb, built on an amd64 machine: an arm64 Debian 12 tree (mmdebstrap) with the
# Build-Depends of debian/control, entered with chroot and run by qemu-user-static through
# binfmt_misc. As `make deb` does for amd64, the wheelhouse is made first (pip wheel, in the
# tree, with the network: arm64 wheels from PyPI) and dpkg-buildpackage then runs with no
# network (`unshare --net`). `make deb-arm64` runs this; docs/BENCHMARKS.md, "arm64 under
# qemu", has its times. Needs root (chroot, mounts).
#
# Output: build/deb/edged_VERSION_arm64.deb. Kept between runs: the tree
# (build/debian-build-arm64.tar, made again when the Build-Depends change) and the wheelhouse
# (build/wheelhouse-arm64/, made again when pyproject.toml changes).
set -eu
cd "$(dirname "$0")/.."
mkdir -p build  # a clean clone has none: the tree's tarball and the wheelhouse are kept there
ROOTDIR=$PWD
MODELS=${MODELS:-$ROOTDIR/models}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
TREE_TAR=build/debian-build-arm64.tar
WHEELS=build/wheelhouse-arm64
WORK=build/arm64-build
VERSION=$(sed -n '1s/^edged (\(.*\)).*/\1/p' debian/changelog)
PATH_IN_TREE=/usr/sbin:/usr/bin:/sbin:/bin

step() { printf '== %s: %s\n' "$(date +%T)" "$*"; }
took() { printf '== %s: %s took %d s\n' "$(date +%T)" "$1" "$(($(date +%s) - $2))"; }

binfmt=/proc/sys/fs/binfmt_misc/qemu-aarch64
if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    echo "binfmt_misc is not mounted: mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc" >&2
    exit 1
fi
if ! grep -qx enabled "$binfmt" 2>/dev/null || ! grep -q '^flags:.*F' "$binfmt"; then
    echo "no qemu-aarch64 binfmt handler with the F flag (in $binfmt): install" \
        "qemu-user-static (Debian's registers it; without systemd: update-binfmts --enable" \
        "qemu-aarch64)" >&2
    exit 1
fi
test -n "$(find "$MODELS" -mindepth 2 -maxdepth 2 -name '[0-9]*' -print -quit)" ||
    { echo "no built models in $MODELS: run make models" >&2; exit 1; }

# debian/control's Build-Depends without versions (debhelper-compat is debhelper's), plus what
# makes the wheelhouse: the build tools are in --variant=buildd; python3-dev and gcc in case a
# dependency has no arm64 wheel and pip builds it; ca-certificates for PyPI.
build_deps=$(sed -n '/^Build-Depends:/,/^[A-Z][A-Za-z-]*:/{/^Build-Depends:/{s/^Build-Depends://;p;d};/^[A-Z]/d;p}' \
    debian/control | tr ',' '\n' | sed 's/(.*)//; s/|.*//; s/[[:space:]]//g' | grep -v '^$' | sort -u)
include=$(printf '%s\n' $build_deps python3-dev ca-certificates cpio | sort -u | paste -sd, -)
if [ ! -f "$TREE_TAR" ] || [ "$include" != "$(cat "$TREE_TAR.deps" 2>/dev/null)" ]; then
    step "mmdebstrap: arm64 bookworm build tree with $include"
    t=$(date +%s)
    mmdebstrap --quiet --architectures=arm64 --variant=buildd --format=tar \
        --include="$include" bookworm "$TREE_TAR.tmp" "$MIRROR"
    mv "$TREE_TAR.tmp" "$TREE_TAR"
    echo "$include" > "$TREE_TAR.deps"
    took "the build tree ($(du -m "$TREE_TAR" | cut -f1) MB)" "$t"
fi

# A fresh copy of the tree for this build, removed at the end.
root=$ROOTDIR/$WORK/root
cleanup() {
    umount "$root/proc" 2>/dev/null || umount --lazy "$root/proc" 2>/dev/null || true
    rm -rf "$ROOTDIR/$WORK"
}
trap cleanup EXIT INT TERM
cleanup
mkdir -p "$root"
tar -xf "$TREE_TAR" -C "$root"
mkdir -p "$root/proc" "$root/build/src"
mount -t proc proc "$root/proc"
in_tree() {
    env -i PATH=$PATH_IN_TREE HOME=/root LANG=C.UTF-8 PIP_CONFIG_FILE=/dev/null \
        PIP_DISABLE_PIP_VERSION_CHECK=1 nice -n 10 "$@"
}
test "$(chroot "$root" dpkg --print-architecture)" = arm64
git ls-files -co --exclude-standard -z | tar --null -T - -c | tar -x -C "$root/build/src"

pyproject_sum=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$pyproject_sum" != "$(cat "$WHEELS/.pyproject.sha256" 2>/dev/null)" ]; then
    step "the wheelhouse: pip wheel in the arm64 tree, from PyPI"
    t=$(date +%s)
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    # pip trusts what this machine trusts (a proxy's CA, say): its bundle, into the tree's copy.
    cp /etc/ssl/certs/ca-certificates.crt "$root/tmp/build-machine-ca.crt"
    in_tree env PIP_CERT=/tmp/build-machine-ca.crt chroot "$root" /bin/sh -ec '
        python3 -m venv /tmp/wheel-venv
        cd /build/src
        /tmp/wheel-venv/bin/pip wheel -q --wheel-dir /build/wheelhouse . setuptools wheel
        rm -f /build/wheelhouse/edged-*.whl'
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS"
    cp "$root"/build/wheelhouse/*.whl "$WHEELS/"
    echo "$pyproject_sum" > "$WHEELS/.pyproject.sha256"
    took "the wheelhouse ($(ls "$WHEELS" | wc -l) wheels, $(du -sm "$WHEELS" | cut -f1) MB)" "$t"
    rm -rf "$root/build/wheelhouse"
fi
# Wheels that pip built here, not PyPI's: no wheel for arm64 on PyPI (linux_aarch64 tags).
built=$(ls "$WHEELS" | grep -- '-linux_aarch64\.whl$' || true)
[ -z "$built" ] || printf 'built from source, no arm64 wheel on PyPI:\n%s\n' "$built"

mkdir -p "$root/build/wheelhouse" "$root/build/models"
cp "$WHEELS"/*.whl "$root/build/wheelhouse/"
(cd "$MODELS" && find . -mindepth 1 -not -path './.build' -not -path './.build/*' -print0 |
    cpio -0 -pdm --quiet "$root/build/models")

step "dpkg-buildpackage in the arm64 tree, no network"
t=$(date +%s)
in_tree unshare --net chroot "$root" /bin/sh -ec '
    cd /build/src
    WHEELHOUSE=/build/wheelhouse MODELS=/build/models dpkg-buildpackage -b -us -uc'
took "dpkg-buildpackage" "$t"

mkdir -p build/deb
for f in "$root"/build/edged*_"$VERSION"_arm64.*; do cp "$f" build/deb/; done
ls -l "build/deb/edged_${VERSION}_arm64.deb"
