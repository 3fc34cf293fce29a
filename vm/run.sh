#!/usr/bin/env bash
# A QEMU guest with an emulated VT-d IOMMU and an emulated Intel 82576 bound
# to vfio-pci, running pfrag's real-VFIO code.
#
#   vm/run.sh test            VFIO integration tests in the guest, then the
#                             captured frames checked on the host
#   vm/run.sh sweep [ARGS]    the sweep with --backend vfio in the guest, plus
#                             QEMU's IOMMU trace counts; writes target/vm/sweep.csv
#   vm/run.sh setup           only install and unpack what the guest needs
#
# Needs root on Debian bookworm (QEMU 10 comes from bookworm-backports).
# Everything is cached under target/vm/. Each boot runs under `timeout`.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
vm="$root/target/vm"
target=x86_64-unknown-linux-gnu
bdf=0000:00:02.0
boot_timeout=${PFRAG_VM_TIMEOUT:-1200}
mkdir -p "$vm"

say() { printf 'vm: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 2; }

have_qemu() {
    command -v qemu-system-x86_64 >/dev/null 2>&1 &&
        qemu-system-x86_64 -device help 2>/dev/null | grep -q '"igb"'
}

# Makes sure apt knows bookworm-backports (for QEMU 10 and the 6.12 kernel).
ensure_backports() {
    if apt-cache policy 2>/dev/null | grep -q 'bookworm-backports'; then
        return
    fi
    local uri
    uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$uri" ] || uri=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    [ -n "$uri" ] || die "no Debian archive found in /etc/apt"
    say "adding bookworm-backports ($uri)"
    echo "deb $uri bookworm-backports main" > /etc/apt/sources.list.d/pfrag-backports.list
    apt-get update -q
}

setup() {
    [ "$(id -u)" = 0 ] || die "run as root (apt-get, and the guest needs nothing else)"
    ensure_backports
    if ! have_qemu; then
        say "installing QEMU from bookworm-backports (the igb device needs QEMU >= 8)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q -t bookworm-backports qemu-system-x86
        have_qemu || die "qemu-system-x86_64 has no igb device after install"
    fi
    for tool in cpio xz gzip; do
        command -v "$tool" >/dev/null 2>&1 && continue
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q cpio xz-utils gzip
        break
    done
    rustup target list --installed 2>/dev/null | grep -q "^$target\$" || rustup target add "$target" || true

    if [ ! -f "$vm/kernel.ok" ]; then
        local pkg
        pkg=$(apt-cache depends -t bookworm-backports linux-image-amd64 2>/dev/null |
            awk '/Depends: linux-image-[0-9]/{print $2; exit}')
        [ -n "$pkg" ] || die "no linux-image-amd64 in bookworm-backports (apt-get update?)"
        say "unpacking kernel $pkg"
        rm -rf "$vm/dl" "$vm/kroot"
        mkdir -p "$vm/dl"
        (cd "$vm/dl" && apt-get download -q -t bookworm-backports "$pkg" 2>/dev/null)
        dpkg -x "$vm"/dl/linux-image-*.deb "$vm/kroot"
        touch "$vm/kernel.ok"
    fi
    if [ ! -f "$vm/busybox.ok" ]; then
        say "unpacking busybox-static"
        rm -rf "$vm/bb"
        mkdir -p "$vm/dl"
        (cd "$vm/dl" && apt-get download -q busybox-static 2>/dev/null)
        dpkg -x "$vm"/dl/busybox-static_*.deb "$vm/bb"
        touch "$vm/busybox.ok"
    fi
}

# Builds a static binary of the guest side; prints its path.
build_static() {
    local kind=$1
    export RUSTFLAGS="-C target-feature=+crt-static"
    case "$kind" in
    tests)
        cargo test -q --release --target "$target" -p vfio-nic --test vfio --no-run \
            --message-format=json 2>/dev/null |
            sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1
        ;;
    sweep)
        cargo build -q --release --target "$target" --example sweep >&2
        echo "$root/target/$target/release/examples/sweep"
        ;;
    esac
}

# Packs the initramfs: busybox, the VFIO modules, the guest binary as
# /bin/guest, and an /init that runs "$@" after binding the NIC.
pack() {
    local bin=$1
    shift
    local kver
    kver=$(ls "$vm/kroot/lib/modules")
    local mods="$vm/kroot/lib/modules/$kver/kernel"
    local d="$vm/initrd.d"
    rm -rf "$d"
    mkdir -p "$d"/{bin,dev,proc,sys,tmp,lib/modules}
    cp "$vm/bb/bin/busybox" "$d/bin/busybox"
    for m in virt/lib/irqbypass drivers/vfio/vfio drivers/vfio/vfio_iommu_type1 \
        drivers/vfio/pci/vfio-pci-core drivers/vfio/pci/vfio-pci; do
        xz -dc "$mods/$m.ko.xz" > "$d/lib/modules/$(basename "$m").ko"
    done
    cp "$bin" "$d/bin/guest"
    {
        echo '#!/bin/busybox sh'
        echo '/bin/busybox --install -s /bin'
        echo 'mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev'
        echo 'for m in irqbypass vfio vfio_iommu_type1 vfio-pci-core vfio-pci; do'
        echo '  insmod /lib/modules/$m.ko || echo "guest: insmod $m failed"'
        echo 'done'
        echo "bdf=$bdf"
        echo 'echo 8086 10c9 > /sys/bus/pci/drivers/vfio-pci/new_id'
        echo 'group=$(basename "$(readlink /sys/bus/pci/devices/$bdf/iommu_group)")'
        echo 'i=0; while [ ! -e /dev/vfio/$group ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done'
        echo 'echo "guest: $bdf in IOMMU group $group, driver $(basename "$(readlink /sys/bus/pci/devices/$bdf/driver)")"'
        echo 'echo 64 > /proc/sys/vm/nr_hugepages'
        echo 'cd /tmp'
        echo "export PFRAG_VFIO_DEVICE=$bdf"
        printf '/bin/guest'
        printf ' %q' "$@"
        echo
        echo 'echo "guest-exit: $?"'
        echo 'if [ -f /tmp/out.csv ]; then echo "=== csv begin"; cat /tmp/out.csv; echo "=== csv end"; fi'
        echo 'poweroff -f'
    } > "$d/init"
    chmod +x "$d/init"
    (cd "$d" && find . | cpio -o -H newc --quiet | gzip -1 > "$vm/initrd.gz")
}

# Boots the guest; the console goes to target/vm/console.log, the frames the
# NIC sent to target/vm/tx.pcap. Extra QEMU arguments follow.
boot() {
    local kernel
    kernel=$(ls "$vm"/kroot/boot/vmlinuz-*)
    rm -f "$vm/tx.pcap" "$vm/console.log"
    say "booting (TCG, timeout ${boot_timeout}s)"
    timeout --foreground -k 10 "$boot_timeout" qemu-system-x86_64 \
        -accel tcg,thread=multi -cpu max -m 2048 -smp 2 \
        -machine q35,kernel-irqchip=split -device intel-iommu,intremap=on \
        -kernel "$kernel" -initrd "$vm/initrd.gz" \
        -append "console=ttyS0 intel_iommu=on iommu.strict=1 quiet panic=-1" \
        -display none -serial "file:$vm/console.log" -monitor none -no-reboot \
        -netdev hubport,id=n0,hubid=0 -device igb,netdev=n0,bus=pcie.0,addr=2.0 \
        -object filter-dump,id=cap0,netdev=n0,file="$vm/tx.pcap",maxlen=65536 \
        "$@" </dev/null || say "qemu exited with status $?"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
setup)
    setup
    ;;
test)
    setup
    say "building the guest tests (static)"
    bin=$(build_static tests)
    [ -x "$bin" ] || die "test binary not built"
    cargo build -q --release --example vmcheck
    pack "$bin" --ignored --test-threads=1 --nocapture
    boot
    cat "$vm/console.log"
    "$root/target/release/examples/vmcheck" test --console "$vm/console.log" --pcap "$vm/tx.pcap"
    ;;
sweep)
    setup
    say "building the sweep (static)"
    bin=$(build_static sweep)
    cargo build -q --release --example vmcheck
    pack "$bin" --backend vfio --device "$bdf" --no-progress --csv /tmp/out.csv "$@"
    boot -d trace:vtd_inv_desc_iotlb_pages,trace:vtd_inv_desc_iotlb_domain,trace:vtd_inv_desc_iotlb_global,trace:vtd_iotlb_page_hit,trace:vtd_iotlb_page_update,trace:e1000e_core_write \
        -D "$vm/trace.log"
    cat "$vm/console.log"
    "$root/target/release/examples/vmcheck" sweep --console "$vm/console.log" \
        --trace "$vm/trace.log" --pcap "$vm/tx.pcap" --out "$vm/sweep.csv"
    ;;
*)
    echo "usage: vm/run.sh test | sweep [SWEEP ARGS] | setup" >&2
    exit 2
    ;;
esac
