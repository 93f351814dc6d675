#!/bin/sh
# The .deb for another target than this machine's Debian 12 amd64: built in a tree of that
# target (mmdebstrap: Debian or Ubuntu, amd64 or arm64) with the Build-Depends of
# debian/control, entered with chroot (an arm64 tree run by qemu-user-static through
# binfmt_misc). The package is for the Python of the tree it is built in (dh-virtualenv links
# the target's own python3): one package per target (docs/OPERATIONS.md, "Where the package
# installs"). As `make deb` does, the wheelhouse is made first (pip wheel, in the tree, with
# the network: the target's wheels from PyPI, built there where PyPI has none) and
# dpkg-buildpackage then runs with no network (`unshare --net`). Needs root (chroot, mounts).
#
#   ARCH=arm64 SUITE=bookworm debian/build-in-tree.sh   (make deb-arm64; the default)
#   ARCH=amd64 SUITE=jammy debian/build-in-tree.sh      (Ubuntu 22.04, JetPack 6's: Python 3.10)
#   ARCH=amd64 SUITE=noble debian/build-in-tree.sh      (Ubuntu 24.04, JetPack 7's: Python 3.12)
#
# Output: build/deb/edged_VERSION_ARCH.deb for bookworm, build/deb/SUITE/ for the others
# (`make deb-targets`). Kept between runs: the tree (build/build-tree-SUITE-ARCH.tar, made again
# when the Build-Depends change) and the wheelhouse (build/wheelhouse-SUITE-ARCH/, made again
# when pyproject.toml changes).
set -eu
cd "$(dirname "$0")/.."
mkdir -p build  # a clean clone has none: the tree's tarball and the wheelhouse are kept there
ROOTDIR=$PWD
MODELS=${MODELS:-$ROOTDIR/models}
ARCH=${ARCH:-arm64}
SUITE=${SUITE:-bookworm}
case $SUITE in
    jammy|noble)  # Ubuntu: dh-virtualenv is in universe; its keyring (ubuntu-keyring) checks it
        COMPONENTS=main,universe
        if [ "$ARCH" = amd64 ]; then DEFAULT_MIRROR=http://archive.ubuntu.com/ubuntu
        else DEFAULT_MIRROR=http://ports.ubuntu.com/ubuntu-ports; fi
        KEYRING=--keyring=$ROOTDIR/build/ubuntu-archive-keyring.gpg  # make deb-targets makes it
        [ -f "$ROOTDIR/build/ubuntu-archive-keyring.gpg" ] ||
            { echo "no build/ubuntu-archive-keyring.gpg: make build/ubuntu-archive-keyring.gpg" >&2; exit 1; } ;;
    *) COMPONENTS=main; DEFAULT_MIRROR=http://deb.debian.org/debian; KEYRING= ;;
esac
MIRROR=${MIRROR:-$DEFAULT_MIRROR}
TREE_TAR=build/build-tree-$SUITE-$ARCH.tar
WHEELS=build/wheelhouse-$SUITE-$ARCH
WORK=build/build-$SUITE-$ARCH
if [ "$SUITE" = bookworm ]; then OUT=build/deb; else OUT=build/deb/$SUITE; fi
VERSION=$(sed -n '1s/^edged (\(.*\)).*/\1/p' debian/changelog)
PATH_IN_TREE=/usr/sbin:/usr/bin:/sbin:/bin

step() { printf '== %s: %s\n' "$(date +%T)" "$*"; }
took() { printf '== %s: %s took %d s\n' "$(date +%T)" "$1" "$(($(date +%s) - $2))"; }

binfmt=/proc/sys/fs/binfmt_misc/qemu-aarch64
# The CPU qemu emulates (read by qemu-aarch64 from each program's environment): a Jetson Orin's
# ARMv8.2, without the pointer authentication that qemu's default CPU emulates ten times slower
# than the rest (Debian 13's binaries use it: dpkg-shlibdeps took over 20 minutes). Makefile.
QEMU_CPU=${QEMU_CPU:-cortex-a76}
export QEMU_CPU
if [ "$ARCH" = arm64 ] && [ "$ARCH" != "$(dpkg --print-architecture)" ]; then
    # a machine without systemd (a container, CI) mounts nothing and registers nothing itself
    [ -e /proc/sys/fs/binfmt_misc/status ] ||
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null || true
    [ -e "$binfmt" ] || update-binfmts --enable qemu-aarch64 2>/dev/null || true
fi
if [ "$ARCH" = "$(dpkg --print-architecture)" ]; then
    :  # the machine's own architecture: no emulation
elif [ "$ARCH" != arm64 ]; then
    echo "ARCH=$ARCH: only this machine's architecture or arm64 (under qemu)" >&2
    exit 1
elif [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    echo "binfmt_misc is not mounted: mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc" >&2
    exit 1
elif ! grep -qx enabled "$binfmt" 2>/dev/null || ! grep -q '^flags:.*F' "$binfmt"; then
    echo "no qemu-aarch64 binfmt handler with the F flag (in $binfmt): install" \
        "qemu-user-static (Debian's registers it; without systemd: update-binfmts --enable" \
        "qemu-aarch64)" >&2
    exit 1
fi
test -n "$(find "$MODELS" -mindepth 2 -maxdepth 2 -name '[0-9]*' -print -quit)" ||
    { echo "no built models in $MODELS: run make models" >&2; exit 1; }

# debian/control's Build-Depends without versions (debhelper-compat is debhelper's), plus what
# makes the wheelhouse: the build tools are in --variant=buildd; python3-dev and gcc in case a
# dependency has no wheel for the target and pip builds it; ca-certificates for PyPI.
build_deps=$(sed -n '/^Build-Depends:/,/^[A-Z][A-Za-z-]*:/{/^Build-Depends:/{s/^Build-Depends://;p;d};/^[A-Z]/d;p}' \
    debian/control | tr ',' '\n' | sed 's/(.*)//; s/|.*//; s/[[:space:]]//g' | grep -v '^$' | sort -u)
include=$(printf '%s\n' $build_deps python3-dev ca-certificates cpio | sort -u | paste -sd, -)
if [ ! -f "$TREE_TAR" ] || [ "$include" != "$(cat "$TREE_TAR.deps" 2>/dev/null)" ]; then
    step "mmdebstrap: $ARCH $SUITE build tree with $include"
    t=$(date +%s)
    # shellcheck disable=SC2086 # KEYRING: one option or none
    mmdebstrap --quiet --architectures="$ARCH" --variant=buildd --format=tar $KEYRING \
        --components="$COMPONENTS" --include="$include" "$SUITE" "$TREE_TAR.tmp" "$MIRROR"
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
    env -i PATH=$PATH_IN_TREE HOME=/root LANG=C.UTF-8 QEMU_CPU=$QEMU_CPU PIP_CONFIG_FILE=/dev/null \
        PIP_DISABLE_PIP_VERSION_CHECK=1 nice -n 10 "$@"
}
test "$(chroot "$root" dpkg --print-architecture)" = "$ARCH"
git ls-files -co --exclude-standard -z | tar --null -T - -c | tar -x -C "$root/build/src"

pyproject_sum=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$pyproject_sum" != "$(cat "$WHEELS/.pyproject.sha256" 2>/dev/null)" ]; then
    step "the wheelhouse: pip wheel in the $ARCH $SUITE tree, from PyPI"
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
# Wheels that pip built here, not PyPI's: none on PyPI for this Python and architecture.
built=$(ls "$WHEELS" | grep -- '-linux_[a-z0-9_]*\.whl$' || true)
[ -z "$built" ] || printf 'built from source, no wheel on PyPI for this target:\n%s\n' "$built"

mkdir -p "$root/build/wheelhouse" "$root/build/models"
cp "$WHEELS"/*.whl "$root/build/wheelhouse/"
(cd "$MODELS" && find . -mindepth 1 -not -path './.build' -not -path './.build/*' -print0 |
    cpio -0 -pdm --quiet "$root/build/models")

step "dpkg-buildpackage in the $ARCH $SUITE tree, no network"
t=$(date +%s)
in_tree unshare --net chroot "$root" /bin/sh -ec '
    cd /build/src
    WHEELHOUSE=/build/wheelhouse MODELS=/build/models dpkg-buildpackage -b -us -uc'
took "dpkg-buildpackage" "$t"

mkdir -p "$OUT"
for f in "$root"/build/edged*_"$VERSION"_"$ARCH".*; do cp "$f" "$OUT/"; done
ls -l "$OUT/edged_${VERSION}_$ARCH.deb"
dpkg-deb -f "$OUT/edged_${VERSION}_$ARCH.deb" Depends
