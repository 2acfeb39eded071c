#!/usr/bin/env bash
# matrix.sh: the kernel-version matrix (`make matrix`, docs/MATRIX.md).
#
# For every kernel in the list, runs the same three checks and prints a table:
#   1. load: every program of every BPF object (the exact bytes embedded in
#      the skeletons) through the kernel's verifier with bpftool, and the
#      instruction counts of each program (xlated, jited, verified);
#   2. the test binaries: every cargo integration test named bpf_* (the
#      BPF_PROG_TEST_RUN suites) or netns_* (end to end over veths), found
#      with `cargo test --no-run --message-format=json`;
#   3. the netns end to end: scripts/demo.sh (and every scripts/demo-*.sh),
#      a real aggregation over veths with XDP attached.
# "host" is the running kernel, checked directly. Every other entry is a
# Debian cloud kernel (linux-image-*-cloud-amd64, fetched with apt-get
# download into the cache, extracted with dpkg-deb, depmod -b) booted with
# QEMU (TCG; KVM only when a probe boot shows that KVM works with it) on a
# small initramfs: busybox, the host tools the checks need with their shared
# libraries (ldd), the test binaries, the aggbox binary and the spec vectors
# at the same absolute paths as on the host, and the needed modules.
#
# Usage: scripts/matrix.sh [KERNEL...]       (default: $KERNELS or "host 6.1 6.12")
#   KERNEL: host | SERIES (6.1, 6.12: the newest Debian cloud package of that
#           series) | a version prefix (6.1.0-57, 6.12.117+deb12) | PATH.deb
# Environment:
#   KERNELS               the list when no argument is given
#   MATRIX_CACHE          downloads and extracted kernels (default /var/cache/aggbox-matrix)
#   MATRIX_OUT            results (default results/matrix): summary.md, summary.json,
#                         and one folder per row (console.log, results.txt)
#   MATRIX_ACCEL          auto (default) | tcg | kvm
#   MATRIX_SMP            guest CPUs (default 2)
#   MATRIX_MEM            guest memory in MiB (default 2048)
#   MATRIX_ROW_TIMEOUT    seconds for one guest row, boot to power-off (default 2400)
#   MATRIX_TEST_TIMEOUT   seconds for one test binary or netns script (default 900)
#   MATRIX_TESTS          regex of the test binaries to run (default "^(bpf|netns)_")
#   MATRIX_MODULES        modules loaded in the guest, with their dependencies
#                         (default "veth bridge cls_bpf sch_ingress act_bpf")
#   MATRIX_NO_BUILD=1     use the newest build outputs in target/release as they are
#                         (no cargo run; for a tree that does not build right now)
#   MATRIX_EXTRA_OBJS     more BPF object files (space-separated) to load on every kernel
#   MATRIX_KEEP=1         keep the work folder (initramfs, plan) for debugging
# Exit status: 0 when every row passed, 1 when a row failed (the reason of
# each failure is printed under the table and in summary.md), 2 on a usage
# or setup error (nothing could be run).

set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PROG=matrix

CACHE=${MATRIX_CACHE:-/var/cache/aggbox-matrix}
OUT=${MATRIX_OUT:-$ROOT/results/matrix}
ACCEL=${MATRIX_ACCEL:-auto}
SMP=${MATRIX_SMP:-2}
MEM=${MATRIX_MEM:-2048}
ROW_TIMEOUT=${MATRIX_ROW_TIMEOUT:-2400}
TEST_TIMEOUT=${MATRIX_TEST_TIMEOUT:-900}
MODULES=${MATRIX_MODULES:-veth bridge cls_bpf sch_ingress act_bpf}
CARGO=${CARGO:-cargo}
TEST_PATTERN=${MATRIX_TESTS:-^(bpf|netns)_}

if [ $# -gt 0 ]; then
    KERNEL_LIST=("$@")
else
    read -r -a KERNEL_LIST <<<"${KERNELS:-host 6.1 6.12}"
fi

# Host tools copied into the guest (with their libraries), when present.
GUEST_TOOLS="bash sh ip ethtool bpftool sysctl flock mount umount timeout cat cp mv rm
    mkdir rmdir ls ln readlink realpath mktemp seq sleep tail head sed grep awk tr cut
    sort uniq wc env id date basename dirname tee touch stat chmod nproc kill ps pgrep
    xargs find ping tcpdump stty uname hostname od expr ss tc bridge"
# Debian packages this script needs beyond `make deps`.
MATRIX_PACKAGES="qemu-system-x86 busybox-static cpio kmod gcc libc6-dev binutils perl dpkg xz-utils zstd"

say() { printf '%s: %s\n' "$PROG" "$*"; }
die() {
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit 2
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# ---------------------------------------------------------------- setup

[ "$(id -u)" = 0 ] || die "needs root (BPF, network namespaces, mounts); run with sudo"

need_guest=0
for k in "${KERNEL_LIST[@]}"; do [ "$k" = host ] || need_guest=1; done

apt_updated=0
apt_update_once() {
    if [ $apt_updated = 0 ]; then
        apt-get update -qq >/dev/null 2>&1 || say "warning: apt-get update failed"
        apt_updated=1
    fi
}

install_missing() {
    local missing="" p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=" $p"
    done
    [ -z "$missing" ] && return 0
    say "installing$missing"
    apt_update_once
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null \
        || die "apt-get install$missing failed"
}
if [ $need_guest = 1 ]; then
    # shellcheck disable=SC2086
    install_missing $MATRIX_PACKAGES
else
    install_missing gcc libc6-dev perl
fi
for t in bpftool perl gcc; do command -v $t >/dev/null || die "$t not found (run make deps)"; done
BPFTOOL=$(readlink -f "$(command -v bpftool)")

mkdir -p "$CACHE/debs" "$CACHE/kernels" "$CACHE/work" "$OUT" || die "cannot create $CACHE or $OUT"
WORK=$(mktemp -d "$CACHE/work/run.XXXXXX")
QEMU_PID=""
on_exit() {
    if [ -n "$QEMU_PID" ] && kill -0 "$QEMU_PID" 2>/dev/null; then kill "$QEMU_PID" 2>/dev/null; fi
    if [ "${MATRIX_KEEP:-0}" = 1 ]; then say "work folder kept: $WORK"; else rm -rf "$WORK"; fi
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- build

cd "$ROOT" || die "cannot cd to $ROOT"
# What is built, recorded now and not at the end: a run takes many minutes,
# and the tree may change or be committed meanwhile. (A summary that named
# the commit made during the run was read as a result of that commit.)
BUILD_AT=$(date -u +%Y-%m-%dT%H:%M:%SZ)
BUILD_REV=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')
git -C "$ROOT" diff-index --quiet HEAD -- 2>/dev/null || BUILD_REV+=" with uncommitted changes"
[ "${MATRIX_NO_BUILD:-0}" = 1 ] && BUILD_REV+=" (MATRIX_NO_BUILD: target/release as built before)"
if [ "${MATRIX_NO_BUILD:-0}" != 1 ]; then
    say "building (cargo build --release, cargo test --release --no-run)"
    t0=$(now)
    # --features bench: the benchmark's BPF programs (bench_*) are built only
    # with it, and they go through the verifier here too (docs/MATRIX.md).
    if ! "$CARGO" build --release --features bench --bins --message-format=json >"$WORK/cargo-bin.json" 2>"$WORK/cargo.log" \
        || ! "$CARGO" test --release --features bench --no-run --message-format=json >"$WORK/cargo-test.json" 2>>"$WORK/cargo.log"; then
        tail -n 30 "$WORK/cargo.log" >&2
        grep -h '"rendered"' "$WORK"/cargo-*.json 2>/dev/null | sed -n 's/.*"rendered":"\([^"]*\).*/\1/p' | head -n 5 >&2
        die "the build failed (nothing was run)"
    fi
    say "build done in $(elapsed "$t0")s"
else
    # No cargo at all: take the newest build outputs under target/release.
    say "MATRIX_NO_BUILD=1: using the build outputs in target/release as they are"
    : >"$WORK/cargo-bin.json"
    : >"$WORK/cargo-test.json"
    for exe in $(ls -t "$ROOT"/target/release/deps/ 2>/dev/null | sed "s|^|$ROOT/target/release/deps/|"); do
        case $(basename "$exe") in *.*) continue ;; esac
        [ -x "$exe" ] && [ -f "$exe" ] || continue
        name=$(basename "$exe")
        name=${name%-*}
        grep -q "\"name\":\"$name\"" "$WORK/cargo-test.json" && continue
        printf '{"reason":"compiler-artifact","target":{"kind":["test"],"name":"%s"},"executable":"%s"}\n' \
            "$name" "$exe" >>"$WORK/cargo-test.json"
    done
fi

json_field() { # FIELD: the string value of "FIELD":"..." on each input line
    sed -n "s/.*\"$1\":\"\\([^\"]*\\)\".*/\\1/p"
}

AGGBOX=$(grep '"reason":"compiler-artifact"' "$WORK/cargo-bin.json" | grep '"kind":\["bin"\]' \
    | grep '"name":"aggbox"' | json_field executable | tail -n 1)
[ -n "$AGGBOX" ] && [ -x "$AGGBOX" ] || AGGBOX=$ROOT/target/release/aggbox
[ -x "$AGGBOX" ] || die "no aggbox binary ($AGGBOX)"

# Test binaries: the integration tests whose name matches MATRIX_TESTS:
# bpf_* (BPF_PROG_TEST_RUN suites) and netns_* (end to end over veths).
TESTS=()
while IFS= read -r line; do
    name=$(json_field name <<<"$(grep -o '"target":{[^}]*}' <<<"$line")")
    exe=$(json_field executable <<<"$line")
    [[ $name =~ $TEST_PATTERN ]] && [ -x "$exe" ] && TESTS+=("$name"$'\t'"$exe")
done < <(grep '"reason":"compiler-artifact"' "$WORK/cargo-test.json" | grep '"kind":\["test"\]' | grep '"executable":"/')
# (Sorted only when there is something to sort: printf of an empty array
# prints one empty line, which became a test with no name and no path; its
# result line then shifted fields and broke the summary's arithmetic.)
[ ${#TESTS[@]} -gt 0 ] && mapfile -t TESTS < <(printf '%s\n' "${TESTS[@]}" | sort)
if [ ${#TESTS[@]} -eq 0 ]; then
    # An explicit MATRIX_TESTS that matches nothing is a load-and-demo run
    # (e.g. measuring a candidate object with MATRIX_EXTRA_OBJS); the default
    # pattern matching nothing means the build is broken.
    [ -n "${MATRIX_TESTS:-}" ] || die "no test binaries matching $TEST_PATTERN in cargo's output ($WORK/cargo-test.json)"
    say "warning: no test binaries match MATRIX_TESTS=$TEST_PATTERN: loads and netns checks only"
fi

# BPF objects: the bytes of each skeleton's embedded object (DATA in
# OUT_DIR/*.skel.rs), so what is loaded here is exactly what aggbox loads.
OUT_DIR=$(grep -h '"reason":"build-script-executed"' "$WORK"/cargo-*.json | grep "\"package_id\":\"path+file://$ROOT#" \
    | json_field out_dir | tail -n 1)
[ -n "$OUT_DIR" ] || OUT_DIR=$(dirname "$(ls -t "$ROOT"/target/release/build/aggbox-*/out/*.skel.rs 2>/dev/null | head -n 1)")
mkdir -p "$WORK/objs" "$WORK/bin"
OBJS=()
for skel in "$OUT_DIR"/*.skel.rs; do
    [ -e "$skel" ] || continue
    stem=$(basename "$skel" .skel.rs)
    obj=$WORK/objs/$stem.bpf.o
    perl -ne 'if (/static DATA: \[u8; (\d+)\] = \[/) { $in = 1; next }
              if ($in) { if (/^\s*\];/) { $in = 0; next } print pack("C*", /(\d+)/g) }' "$skel" >"$obj"
    want=$(sed -n 's/.*static DATA: \[u8; \([0-9]*\)\].*/\1/p' "$skel" | head -n 1)
    [ "$(stat -c %s "$obj")" = "$want" ] && [ "$(head -c 4 "$obj" | od -An -tx1 | tr -d ' ')" = 7f454c46 ] \
        || die "could not extract the BPF object from $skel"
    progs=$(grep -o '\.prog("[^"]*")' "$skel" | sed 's/.prog("\(.*\)")/\1/' | paste -sd, -)
    OBJS+=("$stem"$'\t'"$obj"$'\t'"$progs")
done
[ ${#OBJS[@]} -gt 0 ] || die "no skeletons found in $OUT_DIR"
# Extra objects to put through the same verifier check (e.g. a candidate fix).
for obj in ${MATRIX_EXTRA_OBJS:-}; do
    [ -f "$obj" ] || die "MATRIX_EXTRA_OBJS: no such file: $obj"
    stem=$(basename "$obj" .o)
    stem=${stem%.bpf}
    cp "$obj" "$WORK/objs/$stem.bpf.o"
    # Programs are the global functions in a SEC() section; global functions
    # in .text are BPF-to-BPF subprograms (e.g. the TC copy functions), which
    # the kernel verifies as part of the programs that call them.
    text=$(readelf -SW "$obj" | sed -n 's/^ *\[ *\([0-9]*\)\] \.text .*/\1/p')
    progs=$(readelf -sW "$obj" | awk -v text="${text:--}" '$4 == "FUNC" && $5 == "GLOBAL" && $7 != text { print $8 }' \
        | paste -sd, -)
    OBJS+=("$stem"$'\t'"$WORK/objs/$stem.bpf.o"$'\t'"$progs")
done

gcc -O2 -static -Wall -o "$WORK/bin/proginfo" "$HERE/matrix/proginfo.c" 2>"$WORK/gcc.log" \
    || { cat "$WORK/gcc.log" >&2; die "cannot build scripts/matrix/proginfo.c (gcc, libc6-dev)"; }

NETNS=()
for s in "$ROOT/scripts/demo.sh" "$ROOT"/scripts/demo-*.sh; do
    [ -f "$s" ] && NETNS+=("$(basename "$s" .sh)"$'\t'"$s")
done

PLAN=$WORK/plan
{
    printf 'manifest\t%s\n' "$ROOT"
    printf 'aggbox\t%s\n' "$AGGBOX"
    printf 'bpftool\t%s\n' "$BPFTOOL"
    printf 'proginfo\t%s\n' "$WORK/bin/proginfo"
    printf 'timeout\t%s\n' "$TEST_TIMEOUT"
    for e in "${OBJS[@]}"; do printf 'obj\t%s\n' "$e"; done
    for e in "${TESTS[@]}"; do printf 'test\t%s\n' "$e"; done
    for e in "${NETNS[@]}"; do printf 'netns\t%s\n' "$e"; done
} >"$PLAN"
EXPECTED_PROGS=0
for e in "${OBJS[@]}"; do
    IFS=$'\t' read -r _ _ p <<<"$e"
    EXPECTED_PROGS=$((EXPECTED_PROGS + $(tr ',' '\n' <<<"$p" | grep -c .)))
done
say "plan: ${#OBJS[@]} object(s) with $EXPECTED_PROGS program(s); tests: $(for e in "${TESTS[@]}"; do printf '%s ' "${e%%$'\t'*}"; done); netns: $(for e in "${NETNS[@]}"; do printf '%s ' "${e%%$'\t'*}"; done)"

# ---------------------------------------------------------------- guest userland

# Copy PATH into the staging root at the same path, following symlinks one
# level at a time so that every link on the way exists in the guest too.
stage_path() {
    local stage=$1 p=$2 dir real link n=0
    while [ $n -lt 40 ]; do
        n=$((n + 1))
        dir=$(readlink -f "$(dirname "$p")") || return 1
        real=$dir/$(basename "$p")
        [ -e "$real" ] || [ -L "$real" ] || return 1
        mkdir -p "$stage$dir"
        if [ -L "$real" ]; then
            [ -L "$stage$real" ] || cp -a "$real" "$stage$real"
            link=$(readlink "$real")
            case $link in /*) p=$link ;; *) p=$dir/$link ;; esac
        else
            [ -e "$stage$real" ] || cp -a "$real" "$stage$real"
            return 0
        fi
    done
    return 1
}

stage_binary() { # STAGE PATH: the binary and the libraries ldd names
    local stage=$1 b=$2 lib
    stage_path "$stage" "$b" || return 1
    for lib in $(ldd "$b" 2>/dev/null | grep -oE '/[^ )]+'); do
        stage_path "$stage" "$lib" || say "warning: cannot stage $lib (for $b)"
    done
}

stage_stripped() { # STAGE PATH: a big Rust binary without its debug info
    local stage=$1 b=$2
    mkdir -p "$stage$(dirname "$b")"
    strip --strip-debug -o "$stage$b" "$b" 2>/dev/null || cp -a "$b" "$stage$b"
    stage_binary "$stage" "$b"
}

build_userland() { # -> $WORK/userland.cpio
    local st=$WORK/userland d t e name path
    rm -rf "$st"
    mkdir -p "$st"/{proc,sys,dev,run,tmp,root,etc,var,matrix/bb,matrix/modules}
    ln -s /run "$st/var/run"
    for d in bin sbin lib lib64 lib32 libx32; do
        if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$st/$d"; fi
    done
    mkdir -p "$st/usr/bin" "$st/usr/sbin" "$st/usr/lib"
    local bb
    bb=$(command -v busybox) || return 1
    if ldd "$bb" >/dev/null 2>&1; then say "busybox at $bb is not static (install busybox-static)"; return 1; fi
    cp "$bb" "$st/matrix/bb/busybox"
    for t in $GUEST_TOOLS; do
        path=$(command -v "$t" 2>/dev/null) || continue
        case $path in /*) stage_binary "$st" "$path" || say "warning: cannot stage $t" ;; esac
    done
    [ -d /etc/iproute2 ] && stage_path "$st" /etc/iproute2 && cp -a /etc/iproute2/. "$st/etc/iproute2/" 2>/dev/null
    printf 'root:x:0:0:root:/root:/bin/bash\n' >"$st/etc/passwd"
    printf 'root:x:0:\n' >"$st/etc/group"
    printf '127.0.0.1 localhost\n' >"$st/etc/hosts"
    # What the checks run and read, at the same absolute paths as here.
    stage_stripped "$st" "$AGGBOX"
    for e in "${TESTS[@]}"; do IFS=$'\t' read -r name path <<<"$e"; stage_stripped "$st" "$path"; done
    mkdir -p "$st$ROOT"
    cp -a "$ROOT/scripts" "$st$ROOT/"
    [ -d "$ROOT/deploy" ] && cp -a "$ROOT/deploy" "$st$ROOT/"
    cp -a "$ROOT/Cargo.toml" "$st$ROOT/"
    if [ -d "$ROOT/../shared/spec/vectors" ]; then
        # The tests read ROOT/../shared/spec/vectors as written; stage it at
        # that path and, if shared/ is a symlink, at its target too.
        for d in $(realpath -s -m "$ROOT/../shared/spec") $(readlink -f "$ROOT/../shared/spec"); do
            [ -d "$st$d/vectors" ] && continue
            mkdir -p "$st$d/vectors"
            cp -a "$ROOT/../shared/spec/vectors/." "$st$d/vectors/"
        done
    else
        say "warning: $ROOT/../shared/spec/vectors is missing: the vector tests will fail"
    fi
    mkdir -p "$st$WORK"
    cp -a "$WORK/objs" "$WORK/bin" "$st$WORK/"
    cp "$HERE/matrix/suite.sh" "$st/matrix/suite.sh"
    cp "$PLAN" "$st/matrix/plan"
    cp "$HERE/matrix/init" "$st/init"
    chmod 755 "$st/init" "$st/matrix/suite.sh"
    mknod -m 600 "$st/dev/console" c 5 1 2>/dev/null
    mknod -m 666 "$st/dev/null" c 1 3 2>/dev/null
    (cd "$st" && find . -print0 | cpio --null -o -H newc --quiet) >"$WORK/userland.cpio" || return 1
    rm -rf "$st"
}

build_probe() { # -> $WORK/probe.cpio: boots, prints a marker, powers off
    local st=$WORK/probe
    mkdir -p "$st/bin" "$st/proc"
    cp "$(command -v busybox)" "$st/bin/busybox"
    printf '#!/bin/busybox sh\necho MATRIX-PROBE-OK\n/bin/busybox poweroff -f\n' >"$st/init"
    chmod 755 "$st/init"
    (cd "$st" && find . | cpio -o -H newc --quiet) >"$WORK/probe.cpio"
    rm -rf "$st"
}

# ---------------------------------------------------------------- kernels

# The package-name regex of SPEC: a series (6.1) matches 6.1.0-57 but not
# 6.12.x; anything else is a prefix of the version (6.1.0-57, 6.12.117+deb12).
pkg_regex() {
    local spec=$1 re
    re="^linux-image-${spec//./\\.}"
    if [[ $spec =~ ^[0-9]+\.[0-9]+$ ]]; then re+="[.-][0-9]"; fi
    re+=".*-cloud-amd64\$"
    printf '%s' "${re//+/\\+}"
}

# Newest cached package name that matches SPEC.
resolve_package_cached() {
    ls "$CACHE"/debs/ 2>/dev/null | sed -n 's/^\(linux-image-[^_]*\)_.*\.deb$/\1/p' \
        | grep -E "$(pkg_regex "$1")" | sort -V | tail -n 1
}

# Newest package name that matches SPEC, from apt's lists or else the cache.
resolve_package() {
    local spec=$1 re names
    [[ $spec =~ ^[0-9]+\.[0-9]+ ]] || return 1
    re=$(pkg_regex "$spec")
    names=$(apt-cache pkgnames linux-image- 2>/dev/null | grep -E "$re")
    if [ -z "$names" ] && [ $apt_updated = 0 ] && [ -z "$(resolve_package_cached "$spec")" ]; then
        apt_update_once
        names=$(apt-cache pkgnames linux-image- 2>/dev/null | grep -E "$re")
    fi
    [ -n "$names" ] || names=$(resolve_package_cached "$spec")
    [ -n "$names" ] || return 1
    sort -V <<<"$names" | tail -n 1
}

# SPEC -> sets K_DEB (the cached .deb) or fails with K_ERR.
fetch_kernel() {
    local spec=$1 pkg deb
    K_DEB="" K_ERR=""
    if [[ $spec == *.deb ]]; then
        [ -f "$spec" ] && K_DEB=$(readlink -f "$spec") && return 0
        K_ERR="no such file: $spec"
        return 1
    fi
    pkg=$(resolve_package "$spec") || { K_ERR="no Debian cloud kernel package matches '$spec' (apt-cache pkgnames linux-image-)"; return 1; }
    deb=$(ls -t "$CACHE/debs/${pkg}"_*.deb 2>/dev/null | head -n 1)
    if [ -z "$deb" ]; then
        say "[$spec] apt-get download $pkg"
        if (cd "$CACHE/debs" && apt-get download -o APT::Sandbox::User=root -qq "$pkg" >"$WORK/download.log" 2>&1); then
            deb=$(ls -t "$CACHE/debs/${pkg}"_*.deb 2>/dev/null | head -n 1)
        else
            # Offline, or the archive dropped it: an older cached package of the series will do.
            local older
            older=$(apt_updated=1 resolve_package_cached "$spec")
            [ -n "$older" ] && deb=$(ls -t "$CACHE/debs/${older}"_*.deb 2>/dev/null | head -n 1)
            [ -n "$deb" ] || { K_ERR="apt-get download $pkg failed: $(tail -n 1 "$WORK/download.log")"; return 1; }
            say "[$spec] warning: apt-get download $pkg failed; using the cached $(basename "$deb")"
        fi
    else
        say "[$spec] using cached $(basename "$deb")"
    fi
    [ -n "$deb" ] || { K_ERR="download of $pkg left no .deb in $CACHE/debs"; return 1; }
    K_DEB=$deb
}

# K_DEB -> K_DIR (extracted root), K_VER, K_IMAGE; modules indexed with depmod -b.
extract_kernel() {
    local dir
    dir=$CACHE/kernels/$(basename "$K_DEB" .deb)
    if [ ! -e "$dir/.ok" ]; then
        rm -rf "$dir"
        mkdir -p "$dir"
        dpkg-deb -x "$K_DEB" "$dir" || { K_ERR="dpkg-deb -x $K_DEB failed"; return 1; }
        K_VER=$(ls "$dir/lib/modules" | head -n 1)
        depmod -b "$dir" "$K_VER" || { K_ERR="depmod -b $dir $K_VER failed"; return 1; }
        touch "$dir/.ok"
    fi
    K_DIR=$dir
    K_VER=$(ls "$dir/lib/modules" | head -n 1)
    K_IMAGE=$dir/boot/vmlinuz-$K_VER
    [ -f "$K_IMAGE" ] || { K_ERR="no kernel image in $K_DEB"; return 1; }
}

# -> $1: a cpio with /matrix/modules/*.ko (decompressed) and their load order.
build_modules_cpio() {
    local cpio=$1 st=$WORK/modules m line f base i=0 order
    rm -rf "$st"
    mkdir -p "$st/matrix/modules"
    order=$st/matrix/modules/order
    : >"$order"
    for m in $MODULES; do
        while read -r line; do
            case $line in insmod\ *) ;; *) continue ;; esac
            f=$(awk '{ print $2 }' <<<"$line")
            base=$(basename "$f")
            base=${base%.xz}
            base=${base%.zst}
            base=${base%.gz}
            grep -qx "[0-9]*-$base" "$order" && continue
            i=$((i + 1))
            case $f in
                *.xz) xz -dc "$f" ;;
                *.zst) zstd -qdc "$f" ;;
                *.gz) gzip -dc "$f" ;;
                *) cat "$f" ;;
            esac >"$st/matrix/modules/$(printf '%02d' $i)-$base" || return 1
            printf '%02d-%s\n' $i "$base" >>"$order"
        done < <(modprobe -d "$K_DIR" -S "$K_VER" --show-depends "$m" 2>/dev/null)
    done
    (cd "$st" && find . | cpio -o -H newc --quiet) >"$cpio" || return 1
    rm -rf "$st"
}

QEMU=qemu-system-x86_64
KVM_OK=""
# Does KVM boot this kernel? (Here /dev/kvm exists but QEMU aborts on it.)
choose_accel() {
    case $ACCEL in
        tcg | kvm) K_ACCEL=$ACCEL; return ;;
    esac
    K_ACCEL=tcg
    [ -r /dev/kvm ] && [ -w /dev/kvm ] || return
    [ -f "$WORK/probe.cpio" ] || build_probe
    # (In a subshell that waits, so that bash's "Aborted" notice for QEMU's
    # SIGABRT goes to probe.err too.)
    if (timeout 60 "$QEMU" -nodefaults -no-user-config -display none -no-reboot -accel kvm -cpu host -m 256 \
        -kernel "$K_IMAGE" -initrd "$WORK/probe.cpio" -append "console=ttyS0 panic=-1 quiet" \
        -serial "file:$WORK/probe.log"; exit $?) >"$WORK/probe.err" 2>&1 && grep -q MATRIX-PROBE-OK "$WORK/probe.log"; then
        K_ACCEL=kvm
    else
        say "[$1] KVM cannot run this kernel here ($(head -n 1 "$WORK/probe.err" | cut -c1-100)); using TCG"
    fi
}

# ---------------------------------------------------------------- rows

ROW_NAMES=()
ROW_OK=()
FAIL_LINES=()

json_str() {
    local s=$1
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=$(printf '%s' "$s" | tr -d '\000-\037')
    printf '"%s"' "$s"
}

# Turn RESULTS (the suite's lines) into the row's markdown line, its JSON
# object and its failure reasons.
summarize_row() {
    local spec=$1 release=$2 accel=$3 wall=$4 results=$5 rowdir=$6 extra_reason=$7
    local kind a b c d e f loaded=0 passed=0 failed=0 ignored=0 done=0 kernel=""
    local progs_md="" progs_json="" tests_json="" netns_json="" netns_md="" tests_md=""
    local -a reasons=() load_order=() bad_tests=() bad_netns=()
    local -A loadlog=() load_status=() testfails=() testlog=() netnslog=() test_status=() test_failed=()
    while IFS=$'\t' read -r kind a b c d e f; do
        case $kind in
            kernel) kernel=$a ;;
            load)
                load_status[$a]=$b
                load_order+=("$a")
                ;;
            prog)
                loaded=$((loaded + 1))
                progs_md+="${progs_md:+, }$b $e"
                progs_json+="${progs_json:+,}{\"object\":$(json_str "$a"),\"name\":$(json_str "$b"),\"xlated_insns\":$c,\"jited_bytes\":$d,\"verified_insns\":$e}"
                printf '%s\t%s\t%s\t%s\t%s\n' "$spec" "$b" "$e" "$c" "$d" >>"$WORK/progtable"
                ;;
            loadlog) loadlog[$a]+="$b"$'\n' ;;
            test)
                passed=$((passed + c))
                failed=$((failed + d))
                ignored=$((ignored + e))
                tests_json+="${tests_json:+,}{\"name\":$(json_str "$a"),\"status\":$(json_str "$b"),\"passed\":$c,\"failed\":$d,\"ignored\":$e,\"seconds\":$f}"
                if [ "$b" != pass ]; then
                    tests_md+="${tests_md:+, }$a $b"
                    bad_tests+=("$a")
                    test_status[$a]=$b
                    test_failed[$a]=$d
                fi
                ;;
            testfail) testfails[$a]+="${testfails[$a]:+, }$b" ;;
            testlog) testlog[$a]+="$b"$'\n' ;;
            netns)
                netns_json+="${netns_json:+,}{\"name\":$(json_str "$a"),\"status\":$(json_str "$b"),\"seconds\":$c}"
                netns_md+="${netns_md:+, }$a $b"
                [ "$b" = pass ] || bad_netns+=("$a")
                ;;
            netnslog) netnslog[$a]+="$b"$'\n' ;;
            done) done=1 ;;
        esac
    done < <(tr -d '\r' <"$results" 2>/dev/null)

    [ -n "$extra_reason" ] && reasons+=("$extra_reason")
    local o who why t n
    for o in "${load_order[@]}"; do
        [ "${load_status[$o]}" = ok ] && continue
        who=$(grep -o "prog '[^']*'" <<<"${loadlog[$o]:-}" | head -n 1 | sed "s/prog '\(.*\)'/\1/")
        why=$(grep -v '^libbpf:' <<<"${loadlog[$o]:-}" | grep -v '^$' \
            | grep -v '^processed \|^verification time\|^stack depth\|^Error:' | tail -n 3 | paste -sd'|' -)
        reasons+=("${who:-$o} ($o.bpf.o) rejected by the verifier: ${why:-see $rowdir/console.log}")
        local e2 oname opath oprogs p2
        for e2 in "${OBJS[@]}"; do
            IFS=$'\t' read -r oname opath oprogs <<<"$e2"
            [ "$oname" = "$o" ] || continue
            for p2 in ${oprogs//,/ }; do
                if [ "$p2" = "$who" ]; then
                    printf '%s\t%s\tREJECTED\n' "$spec" "$p2" >>"$WORK/progtable"
                    progs_md+="${progs_md:+, }$p2 REJECTED"
                else
                    printf '%s\t%s\tnot loaded\n' "$spec" "$p2" >>"$WORK/progtable"
                fi
            done
        done
        printf '\n### %s: %s rejected by the verifier\n\n```\n%s```\n' "$spec" "${who:-$o}" "${loadlog[$o]:-}" \
            >>"$WORK/failure-details.md"
    done
    for t in "${bad_tests[@]}"; do
        reasons+=("test $t ${test_status[$t]} (${test_failed[$t]} failed${testfails[$t]:+: ${testfails[$t]}}): $(grep -v '^$' <<<"${testlog[$t]:-}" | head -n 2 | paste -sd'|' -)")
        printf '\n### %s: %s %s\n\nfailed: %s\n\n```\n%s```\n' "$spec" "$t" "${test_status[$t]}" \
            "${testfails[$t]:--}" "${testlog[$t]:-}" >>"$WORK/failure-details.md"
    done
    for n in "${bad_netns[@]}"; do
        reasons+=("netns check $n failed: $(grep -v '^$' <<<"${netnslog[$n]:-}" | grep -v 'FAILED (exit' | tail -n 2 | paste -sd'|' -)")
        printf '\n### %s: netns check %s failed\n\n```\n%s```\n' "$spec" "$n" "${netnslog[$n]:-}" >>"$WORK/failure-details.md"
    done
    if [ -z "$extra_reason" ]; then
        [ -n "$kernel" ] || reasons+=("no results from the suite (see $rowdir/console.log)")
        [ -n "$kernel" ] && [ $done = 0 ] && reasons+=("the suite did not finish (see $rowdir/console.log)")
    fi
    [ -n "$kernel" ] && [ $loaded -lt "$EXPECTED_PROGS" ] && [ ${#load_order[@]} -gt 0 ] \
        && ! printf '%s\n' "${reasons[@]}" | grep -q 'rejected by the verifier' \
        && reasons+=("only $loaded of $EXPECTED_PROGS programs loaded")

    local ok=1 verdict=PASS
    [ ${#reasons[@]} -gt 0 ] && ok=0 verdict=FAIL
    [ -z "$release" ] && release=${kernel:-?}
    local tests_cell="$passed passed / $failed failed"
    [ "$ignored" -gt 0 ] && tests_cell+=" / $ignored ignored"
    [ -n "$tests_md" ] && tests_cell+=" ($tests_md)"
    printf '| %s | %s | %s | %s/%s | %s | %s | %s | %ss | %s |\n' \
        "$spec" "$release" "$accel" "$loaded" "$EXPECTED_PROGS" "$tests_cell" "${netns_md:--}" \
        "${progs_md:--}" "$wall" "$verdict" >>"$WORK/table.md"
    local reasons_json="" x
    for x in "${reasons[@]}"; do
        reasons_json+="${reasons_json:+,}$(json_str "$x")"
        FAIL_LINES+=("$spec: $x")
    done
    printf '{"kernel":%s,"release":%s,"accel":%s,"status":%s,"programs_loaded":%d,"programs_expected":%d,"tests_passed":%d,"tests_failed":%d,"tests_ignored":%d,"wall_seconds":%s,"programs":[%s],"tests":[%s],"netns":[%s],"reasons":[%s],"logs":%s}\n' \
        "$(json_str "$spec")" "$(json_str "$release")" "$(json_str "$accel")" "$(json_str "${verdict,,}")" \
        "$loaded" "$EXPECTED_PROGS" "$passed" "$failed" "$ignored" "$wall" \
        "$progs_json" "$tests_json" "$netns_json" "$reasons_json" "$(json_str "$rowdir")" >>"$WORK/rows.json"
    ROW_NAMES+=("$spec")
    ROW_OK+=("$ok")
    say "[$spec] $verdict: $loaded/$EXPECTED_PROGS programs loaded, $passed tests passed, $failed failed, ${wall}s"
}

run_host_row() {
    local rowdir=$OUT/host t0
    rm -rf "$rowdir"
    mkdir -p "$rowdir"
    say "[host] $(uname -r): running the suite directly"
    t0=$(now)
    : >"$rowdir/results.txt"
    bash "$HERE/matrix/suite.sh" "$PLAN" "$rowdir/results.txt" >"$rowdir/console.log" 2>&1
    summarize_row host "$(uname -r)" none "$(elapsed "$t0")" "$rowdir/results.txt" "$rowdir" ""
}

run_guest_row() {
    local spec=$1 rowdir t0 rc reason=""
    rowdir=$OUT/$(tr -c 'A-Za-z0-9._+-' '_' <<<"$spec" | sed 's/_$//')
    rm -rf "$rowdir"
    mkdir -p "$rowdir"
    t0=$(now)
    : >"$rowdir/results.txt"
    K_VER=""
    if ! fetch_kernel "$spec" || ! extract_kernel; then
        summarize_row "$spec" "" - "$(elapsed "$t0")" "$rowdir/results.txt" "$rowdir" "cannot get the kernel: $K_ERR"
        return
    fi
    if [ ! -f "$WORK/userland.cpio" ]; then
        say "building the guest userland (initramfs)"
        build_userland || { summarize_row "$spec" "$K_VER" - "$(elapsed "$t0")" "$rowdir/results.txt" "$rowdir" "cannot build the initramfs"; return; }
    fi
    if ! build_modules_cpio "$WORK/modules.cpio"; then
        summarize_row "$spec" "$K_VER" - "$(elapsed "$t0")" "$rowdir/results.txt" "$rowdir" "cannot collect the modules ($MODULES)"
        return
    fi
    cat "$WORK/userland.cpio" "$WORK/modules.cpio" >"$WORK/initrd.cpio"
    choose_accel "$spec"
    local cpu=max
    [ "$K_ACCEL" = kvm ] && cpu=host
    local accel_opt=$K_ACCEL
    [ "$K_ACCEL" = tcg ] && accel_opt=tcg,thread=multi
    say "[$spec] booting $K_VER ($K_ACCEL, $SMP cpus, ${MEM}M, initramfs $(($(stat -c %s "$WORK/initrd.cpio") / 1048576))M)"
    timeout --kill-after=10 "$ROW_TIMEOUT" "$QEMU" -nodefaults -no-user-config -display none -no-reboot \
        -accel "$accel_opt" -cpu "$cpu" -smp "$SMP" -m "$MEM" \
        -kernel "$K_IMAGE" -initrd "$WORK/initrd.cpio" \
        -append "console=ttyS0 panic=-1 oops=panic loglevel=4 mitigations=off" \
        -serial "file:$rowdir/console.log" -serial "file:$rowdir/results.raw" \
        >"$rowdir/qemu.log" 2>&1 &
    QEMU_PID=$!
    wait $QEMU_PID
    rc=$?
    QEMU_PID=""
    tr -d '\r' <"$rowdir/results.raw" >"$rowdir/results.txt" 2>/dev/null
    rm -f "$rowdir/results.raw" "$WORK/initrd.cpio"
    if ! grep -q '^done' "$rowdir/results.txt"; then
        if [ $rc = 124 ] || [ $rc = 137 ]; then
            reason="the guest did not finish within ${ROW_TIMEOUT}s (MATRIX_ROW_TIMEOUT)"
        elif grep -q 'Kernel panic' "$rowdir/console.log" 2>/dev/null; then
            reason="kernel panic: $(grep -m1 'Kernel panic' "$rowdir/console.log" | tr -d '\r' | cut -c1-200)"
        elif [ $rc != 0 ]; then
            reason="qemu exited with $rc: $(tail -n 1 "$rowdir/qemu.log")"
        fi
    fi
    summarize_row "$spec" "$K_VER" "$K_ACCEL" "$(elapsed "$t0")" "$rowdir/results.txt" "$rowdir" "$reason"
}

T_ALL=$(now)
: >"$WORK/table.md"
: >"$WORK/rows.json"
: >"$WORK/progtable"
: >"$WORK/failure-details.md"
for spec in "${KERNEL_LIST[@]}"; do
    if [ "$spec" = host ]; then run_host_row; else run_guest_row "$spec"; fi
done

# ---------------------------------------------------------------- summary

{
    printf '# Kernel-version matrix\n\n'
    printf 'Generated by `make matrix` (scripts/matrix.sh) on %s, in %ss; the tree built at %s: commit %s.\n\n' \
        "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(elapsed "$T_ALL")" "$BUILD_AT" "$BUILD_REV"
    printf '| kernel | release | accel | programs loaded | tests | netns | verified insns per program | wall | status |\n'
    printf '|---|---|---|---|---|---|---|---|---|\n'
    cat "$WORK/table.md"
    if [ -s "$WORK/progtable" ]; then
        printf '\nInstructions per program: verified (processed by the verifier) / xlated / jited bytes.\n\n'
        printf '| program |'
        for r in "${ROW_NAMES[@]}"; do printf ' %s |' "$r"; done
        printf '\n|---|'
        for _ in "${ROW_NAMES[@]}"; do printf -- '---|'; done
        printf '\n'
        for p in $(cut -f2 "$WORK/progtable" | awk '!seen[$0]++'); do
            printf '| %s |' "$p"
            for r in "${ROW_NAMES[@]}"; do
                printf ' %s |' "$(awk -F'\t' -v r="$r" -v p="$p" '$1 == r && $2 == p {
                    if (NF >= 5) printf "%s / %s / %s", $3, $4, $5; else printf "%s", $3 }' "$WORK/progtable")"
            done
            printf '\n'
        done
    fi
    if [ ${#FAIL_LINES[@]} -gt 0 ]; then
        printf '\n## Failures\n\n'
        for l in "${FAIL_LINES[@]}"; do printf -- '- %s\n' "$l"; done
        cat "$WORK/failure-details.md"
    fi
} >"$OUT/summary.md"
{
    printf '{"generated":%s,"built_at":%s,"built_from":%s,"rows":[\n' "$(json_str "$(date -u +%Y-%m-%dT%H:%M:%SZ)")" \
        "$(json_str "$BUILD_AT")" "$(json_str "$BUILD_REV")"
    paste -sd, "$WORK/rows.json" | sed 's/},{"kernel"/},\n{"kernel"/g'
    printf ']}\n'
} >"$OUT/summary.json"

echo
sed -n '/^| kernel/,/^$/p' "$OUT/summary.md"
sed -n '/^Instructions per program/,/^$/p; /^| program/,/^$/p' "$OUT/summary.md" | awk '!seen[$0]++'
echo "summary: $OUT/summary.md, $OUT/summary.json"
if [ ${#FAIL_LINES[@]} -gt 0 ]; then
    echo
    echo "FAILED rows:"
    for l in "${FAIL_LINES[@]}"; do echo "  $l"; done
    exit 1
fi
echo "every row passed"
exit 0
