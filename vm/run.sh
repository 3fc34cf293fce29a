#!/usr/bin/env bash
# A QEMU guest with an emulated VT-d IOMMU, an emulated Intel 82576 and a
# virtio-net device (modern only, behind the IOMMU), both bound to vfio-pci,
# running pfrag's real-VFIO code. The virtio-net device's backend is a tap
# in a network namespace of this script's own, with no address: its frames
# go nowhere outside this machine.
#
#   vm/run.sh test [FILTER]   VFIO integration tests in the guest (those
#                             matching FILTER), then the captured frames
#                             checked on the host
#   vm/run.sh sweep [ARGS]    the sweep with --backend vfio in the guest, plus
#                             QEMU's IOMMU trace counts; writes target/vm/sweep.csv
#                             (--nic virtio: on the virtio-net device)
#   vm/run.sh setup           only install and unpack what the guest needs
#
# The environment picks the combination:
#   VM_KERNEL=6.12|7.3|iommufd
#                        guest kernel: Debian's from bookworm-backports (6.12,
#                        the default) or trixie-backports (7.3), or one built
#                        from trixie's linux-source-6.12 with the options of
#                        vm/kernel/iommufd.config (iommufd, the VFIO device
#                        cdev; everything built in), cached per source
#                        version and configuration
#   VM_AW_BITS=39|48     the emulated VT-d's IOVA width (default 48)
#
# To look into a guest that stops making progress:
#   PFRAG_VM_TIMEOUT=SECS  how long a boot may take before it is stopped
#                          (default 1200)
#   PFRAG_VM_MONITOR=PATH  a QEMU monitor on the Unix socket PATH, e.g. for
#                          `info registers -a`, or `sendkey alt-sysrq-w` (the
#                          guest's blocked tasks, on its console)
#
# Needs root on Debian bookworm (QEMU 10 comes from bookworm-backports).
# Everything is cached under target/vm/. Each boot runs under `timeout`.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
vm="$root/target/vm"
# Where cargo puts what it builds (the guest binaries, vmcheck).
cargo_target=${CARGO_TARGET_DIR:-$root/target}
target=x86_64-unknown-linux-gnu
bdf=0000:00:02.0
vbdf=0000:00:03.0
boot_timeout=${PFRAG_VM_TIMEOUT:-1200}
kernel_line=${VM_KERNEL:-6.12}
aw_bits=${VM_AW_BITS:-48}
monitor=none
[ -z "${PFRAG_VM_MONITOR:-}" ] || monitor="unix:$PFRAG_VM_MONITOR,server=on,wait=off"
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

# The guest kernel's own directory under target/vm (for iommufd, named by
# build_kernel after the source version and the configuration).
iommufd_dir=""
kdir() {
    if [ "$kernel_line" = iommufd ]; then
        [ -n "$iommufd_dir" ] || die "the iommufd kernel's directory is not known yet"
        echo "$iommufd_dir"
    else
        echo "$vm/kernel-$kernel_line"
    fi
}

# apt-get and apt-cache against one suite only, with their own state under
# target/vm: trixie-backports is never added to the host's sources.
suite_apt() {
    local tool=$1 suite=$2
    shift 2
    local a="$vm/apt-$suite"
    if [ ! -f "$a/updated" ]; then
        mkdir -p "$a/lists/partial" "$a/cache/archives/partial"
        local uri
        uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
        [ -n "$uri" ] || uri=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
        [ -n "$uri" ] || die "no Debian archive found in /etc/apt"
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri $suite main" \
            > "$a/sources.list"
        apt-get -q -o Dir::Etc::SourceList="$a/sources.list" -o Dir::Etc::SourceParts=/dev/null \
            -o Dir::State::Lists="$a/lists" -o Dir::Cache="$a/cache" update >&2
        touch "$a/updated"
    fi
    "$tool" -q -o Dir::Etc::SourceList="$a/sources.list" -o Dir::Etc::SourceParts=/dev/null \
        -o Dir::State::Lists="$a/lists" -o Dir::Cache="$a/cache" "$@"
}

# Builds the iommufd guest kernel: tinyconfig of trixie's linux-source-6.12
# with vm/kernel/iommufd.config merged in, everything built in. The result
# goes to target/vm/kernel-iommufd-HASH/bzImage, HASH covering the source
# package's version and the fragment, and is reused while both stay the same.
build_kernel() {
    local frag="$root/vm/kernel/iommufd.config"
    local ver key k
    [ -f "$frag" ] || die "no $frag"
    ver=$(suite_apt apt-cache trixie policy linux-source-6.12 | awk '/Candidate:/{print $2; exit}')
    case "$ver" in
    "" | "(none)") die "no linux-source-6.12 in trixie" ;;
    esac
    key=$({ echo "linux-source-6.12 $ver"; cat "$frag"; } | sha256sum | cut -c1-16)
    k="$vm/kernel-iommufd-$key"
    iommufd_dir=$k
    [ -f "$k/ok" ] && return
    local tool
    for tool in flex bison bc make gcc xz; do
        command -v "$tool" >/dev/null 2>&1 && continue
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q flex bison bc make gcc xz-utils
        break
    done
    # objtool (x86-64) links against libelf.
    [ -f /usr/include/gelf.h ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -q libelf-dev
    local src="$vm/linux-source-$ver"
    if [ ! -f "$src/ok" ]; then
        say "unpacking linux-source-6.12 $ver"
        rm -rf "$src"
        mkdir -p "$src/dl"
        (cd "$src/dl" && suite_apt apt-get trixie download "linux-source-6.12=$ver" 2>/dev/null)
        dpkg -x "$src"/dl/linux-source-6.12_*.deb "$src/deb"
        tar -xf "$src"/deb/usr/src/linux-source-6.12.tar.* -C "$src"
        rm -rf "$src/dl" "$src/deb"
        touch "$src/ok"
    fi
    local tree="$src/linux-source-6.12" b="$k/build"
    rm -rf "$k"
    mkdir -p "$b"
    say "configuring the iommufd kernel ($ver, $frag)"
    make -s -C "$tree" O="$b" tinyconfig >"$k/config.log" 2>&1 || { cat "$k/config.log" >&2; die "make tinyconfig failed"; }
    (cd "$b" && "$tree/scripts/kconfig/merge_config.sh" -m .config "$frag") >>"$k/config.log" 2>&1 ||
        { cat "$k/config.log" >&2; die "merge_config.sh failed"; }
    make -s -C "$tree" O="$b" olddefconfig >>"$k/config.log" 2>&1 || { cat "$k/config.log" >&2; die "make olddefconfig failed"; }
    # merge_config.sh does not fail when Kconfig drops an option (a missing
    # dependency): every line of the fragment must be in the final .config.
    local line dropped=""
    while IFS= read -r line; do
        case "$line" in
        CONFIG_*=* | "# CONFIG_"*" is not set") ;;
        *) continue ;;
        esac
        grep -qxF -- "$line" "$b/.config" || dropped="$dropped ${line#\# }"
    done <"$frag"
    [ -z "$dropped" ] || die "olddefconfig dropped or changed:$dropped (see $b/.config)"
    say "building the iommufd kernel (make -j$(nproc) bzImage, log in $k/build.log)"
    local t0=$SECONDS
    make -C "$tree" O="$b" -j"$(nproc)" bzImage >"$k/build.log" 2>&1 ||
        { tail -40 "$k/build.log" >&2; die "the kernel build failed"; }
    say "built the iommufd kernel in $((SECONDS - t0)) s"
    cp "$b/arch/x86/boot/bzImage" "$k/bzImage"
    cp "$b/.config" "$k/config"
    rm -rf "$b"
    touch "$k/ok"
}

# Downloads and unpacks the guest kernel of $VM_KERNEL: the image and, for
# kernels that ship them apart, its binary and modules packages.
fetch_kernel() {
    local k suite
    if [ "$kernel_line" = iommufd ]; then
        build_kernel
        return
    fi
    k=$(kdir)
    [ -f "$k/ok" ] && return
    case "$kernel_line" in
    6.12) suite=bookworm-backports ;;
    7.3) suite=trixie-backports ;;
    *) die "VM_KERNEL=$kernel_line: use 6.12, 7.3 or iommufd" ;;
    esac
    local img pkgs
    img=$(suite_apt apt-cache "$suite" depends linux-image-amd64 |
        awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    [ -n "$img" ] || die "no linux-image-amd64 in $suite"
    case "$img" in
    linux-image-"$kernel_line".*) ;;
    *) die "$suite carries $img, not a $kernel_line kernel" ;;
    esac
    pkgs="$img $(suite_apt apt-cache "$suite" depends "$img" |
        awk '/Depends: linux-(binary|modules)-[0-9]/{print $2}' | tr '\n' ' ')"
    say "unpacking $pkgs"
    rm -rf "$k"
    mkdir -p "$k/dl"
    # shellcheck disable=SC2086 # one word per package
    (cd "$k/dl" && suite_apt apt-get "$suite" download $pkgs 2>/dev/null)
    for deb in "$k"/dl/*.deb; do dpkg -x "$deb" "$k/root"; done
    rm -rf "$k/dl"
    touch "$k/ok"
}

# The unpacked kernel's module tree (lib/modules/VER or usr/lib/modules/VER).
moddir() {
    local d
    for d in "$(kdir)"/root/lib/modules/* "$(kdir)"/root/usr/lib/modules/*; do
        [ -d "$d/kernel" ] && { echo "$d"; return; }
    done
    die "no modules under $(kdir)"
}

# The unpacked (or built) kernel image.
vmlinuz() {
    local f
    if [ "$kernel_line" = iommufd ]; then
        echo "$(kdir)/bzImage"
        return
    fi
    for f in "$(kdir)"/root/boot/vmlinuz-* "$(moddir)/vmlinuz"; do
        [ -f "$f" ] && { echo "$f"; return; }
    done
    die "no vmlinuz under $(kdir)"
}

setup() {
    [ "$(id -u)" = 0 ] || die "run as root (apt-get, and the guest needs nothing else)"
    ensure_backports
    if ! have_qemu; then
        say "installing QEMU from bookworm-backports (the igb device needs QEMU >= 8)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q -t bookworm-backports qemu-system-x86
        have_qemu || die "qemu-system-x86_64 has no igb device after install"
    fi
    for tool in cpio xz gzip ip; do
        command -v "$tool" >/dev/null 2>&1 && continue
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q cpio xz-utils gzip iproute2
        break
    done
    rustup target list --installed 2>/dev/null | grep -q "^$target\$" || rustup target add "$target" || true

    fetch_kernel
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
        # The guest needs no DPDK (it is only the peers example's), and
        # Debian's static DPDK archives do not link into a static binary.
        PFRAG_NO_DPDK=1 cargo build -q --release --target "$target" --example sweep >&2
        echo "$cargo_target/$target/release/examples/sweep"
        ;;
    sender)
        cargo build -q --release --target "$target" -p vfio-nic --example vfio_send >&2
        echo "$cargo_target/$target/release/examples/vfio_send"
        ;;
    esac
}

# Packs the initramfs: busybox, the VFIO modules (none for the iommufd
# kernel, which has VFIO built in), the guest binary as /bin/guest (and
# $send_bin, if set, as /bin/vfio_send), and an /init that runs "$@" after
# binding the NIC.
pack() {
    local bin=$1
    shift
    local mods=""
    [ "$kernel_line" = iommufd ] || mods="$(moddir)/kernel"
    local d="$vm/initrd.d"
    rm -rf "$d"
    mkdir -p "$d"/{bin,dev,proc,sys,tmp,lib/modules}
    cp "$vm/bb/bin/busybox" "$d/bin/busybox"
    [ -z "$mods" ] || for m in virt/lib/irqbypass drivers/vfio/vfio drivers/vfio/vfio_iommu_type1 \
        drivers/vfio/pci/vfio-pci-core drivers/vfio/pci/vfio-pci; do
        xz -dc "$mods/$m.ko.xz" > "$d/lib/modules/$(basename "$m").ko"
    done
    cp "$bin" "$d/bin/guest"
    [ -z "${send_bin:-}" ] || cp "$send_bin" "$d/bin/vfio_send"
    {
        echo '#!/bin/busybox sh'
        echo '/bin/busybox --install -s /bin'
        echo 'mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev'
        # Every sysrq function, for a look at a guest that stops.
        echo 'echo 1 > /proc/sys/kernel/sysrq'
        if [ -n "$mods" ]; then
            echo 'for m in irqbypass vfio vfio_iommu_type1 vfio-pci-core vfio-pci; do'
            echo '  insmod /lib/modules/$m.ko || echo "guest: insmod $m failed"'
            echo 'done'
        fi
        echo "bdf=$bdf"
        echo 'echo "guest kernel: $(uname -r)"'
        echo 'if [ -e /dev/iommu ]; then echo "guest iommufd: yes"; else echo "guest iommufd: no"; fi'
        # MGAW (bits 21:16 of the VT-d capability register) is the width less one.
        echo 'cap=$(cat /sys/class/iommu/dmar*/intel-iommu/cap 2>/dev/null | head -1)'
        echo 'if [ -n "$cap" ]; then echo "guest iommu: $(( ((0x$cap >> 16) & 63) + 1 ))-bit IOVA width (VT-d cap 0x$cap)"; else echo "guest iommu: no VT-d capability register"; fi'
        echo 'echo 8086 10c9 > /sys/bus/pci/drivers/vfio-pci/new_id'
        echo 'group=$(basename "$(readlink /sys/bus/pci/devices/$bdf/iommu_group)")'
        echo 'i=0; while [ ! -e /dev/vfio/$group ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done'
        echo 'echo "guest: $bdf in IOMMU group $group, driver $(basename "$(readlink /sys/bus/pci/devices/$bdf/driver)")"'
        # The virtio-net device: whatever driver holds it lets go, and
        # vfio-pci takes it.
        echo "vbdf=$vbdf"
        echo 'vdev=/sys/bus/pci/devices/$vbdf'
        echo 'echo vfio-pci > $vdev/driver_override'
        echo '[ -e $vdev/driver ] && echo $vbdf > $vdev/driver/unbind'
        echo 'echo $vbdf > /sys/bus/pci/drivers_probe'
        echo 'vgroup=$(basename "$(readlink $vdev/iommu_group)")'
        echo 'i=0; while [ ! -e /dev/vfio/$vgroup ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done'
        echo 'echo "guest: $vbdf (virtio-net) in IOMMU group $vgroup, driver $(basename "$(readlink $vdev/driver)")"'
        # The VFIO device cdevs (kernels with VFIO_DEVICE_CDEV).
        echo 'if [ -d /dev/vfio/devices ]; then echo "guest: VFIO device cdevs:" $(ls /dev/vfio/devices); fi'
        echo 'echo 64 > /proc/sys/vm/nr_hugepages'
        echo 'cd /tmp'
        echo "export PFRAG_VFIO_DEVICE=$bdf"
        echo "export PFRAG_VIRTIO_DEVICE=$vbdf"
        [ -z "${send_bin:-}" ] || echo 'export PFRAG_SEND_BIN=/bin/vfio_send'
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

# A network namespace of our own holding the virtio-net device's tap, up,
# with no address (IPv6 off, so none is configured): what the guest sends
# goes into that namespace's stack and no further.
ns=""
netns_up() {
    # Namespaces of runs that were killed before their trap ran.
    local old
    for old in $(ip netns list 2>/dev/null | awk '/^pfrag-vm-[0-9]+/{print $1}'); do
        kill -0 "${old#pfrag-vm-}" 2>/dev/null || ip netns del "$old" 2>/dev/null || true
    done
    ns="pfrag-vm-$$"
    ip netns add "$ns"
    trap 'ip netns del "$ns" 2>/dev/null || true' EXIT
    ip netns exec "$ns" sh -c 'echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6; echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6'
    ip -n "$ns" tuntap add dev pfragtap0 mode tap vnet_hdr
    ip -n "$ns" link set pfragtap0 up
}

# Boots the guest; the console goes to target/vm/console.log, the frames the
# 82576 sent to target/vm/tx.pcap, and those of the virtio-net device (GSO
# super-frames as the driver posted them) to target/vm/virtio.pcap. Extra
# QEMU arguments follow.
boot() {
    local kernel
    kernel=$(vmlinuz)
    rm -f "$vm/tx.pcap" "$vm/virtio.pcap" "$vm/console.log"
    netns_up
    say "booting kernel $kernel_line, aw-bits $aw_bits (TCG, timeout ${boot_timeout}s)"
    # no_timer_check: at boot the kernel busy-waits 160 million TSC cycles
    # (under TCG the host's TSC: some 65 ms at 2.4 GHz) for 5 timer ticks,
    # and panics ("timer doesn't work through Interrupt-remapped IO-APIC")
    # if they do not come; on a loaded host QEMU's timer can miss that
    # window. tsc=reliable: under TCG the guest's TSC is the host's, so the
    # clocksource watchdog has nothing to find; without it a 7.3 guest
    # stopped at boot with one CPU in the watchdog's cross-CPU skew check
    # and the other in stop_machine, both with interrupts off. -smp 1: the
    # guest tests run one at a time on one thread; with two vCPUs on a
    # loaded 2-core host, a guest twice stopped for good (once at boot with
    # RCU stall reports, once between two tests) waiting on the other vCPU.
    # virtio-net: modern only, behind the IOMMU (ACCESS_PLATFORM), one queue
    # pair; ioeventfd=off, so that every notification (the sweep's marks on
    # the unused receive queue too) passes QEMU's traced handler.
    ip netns exec "$ns" timeout --foreground -k 10 "$boot_timeout" qemu-system-x86_64 \
        -accel tcg -cpu max -m 2048 -smp 1 \
        -machine q35,kernel-irqchip=split -device intel-iommu,intremap=on,aw-bits="$aw_bits" \
        -kernel "$kernel" -initrd "$vm/initrd.gz" \
        -append "console=ttyS0 intel_iommu=on iommu.strict=1 quiet panic=-1 no_timer_check tsc=reliable" \
        -display none -serial "file:$vm/console.log" -monitor "$monitor" -no-reboot \
        -netdev hubport,id=n0,hubid=0 -device igb,netdev=n0,bus=pcie.0,addr=2.0 \
        -object filter-dump,id=cap0,netdev=n0,file="$vm/tx.pcap",maxlen=65536 \
        -netdev tap,id=v0,ifname=pfragtap0,script=no,downscript=no,vhost=off,vnet_hdr=on \
        -device virtio-net-pci,netdev=v0,bus=pcie.0,addr=3.0,disable-legacy=on,iommu_platform=on,mq=off,ioeventfd=off \
        -object filter-dump,id=cap1,netdev=v0,file="$vm/virtio.pcap",maxlen=131072 \
        "$@" </dev/null || say "qemu exited with status $?"
}

case "$aw_bits" in
39 | 48) ;;
*) die "VM_AW_BITS=$aw_bits: use 39 or 48" ;;
esac
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
    send_bin=$(build_static sender)
    [ -x "$send_bin" ] || die "vfio_send not built"
    cargo build -q --release --example vmcheck
    # The iommufd tests need a kernel with iommufd: the others skip them.
    skip=""
    [ "$kernel_line" = iommufd ] || skip="--skip iommufd_"
    # shellcheck disable=SC2086 # $skip is two words or none
    pack "$bin" --ignored --test-threads=1 --nocapture $skip "$@"
    boot
    cat "$vm/console.log"
    "$cargo_target/release/examples/vmcheck" test --console "$vm/console.log" --pcap "$vm/tx.pcap" \
        --virtio-pcap "$vm/virtio.pcap"
    ;;
sweep)
    setup
    say "building the sweep (static)"
    bin=$(build_static sweep)
    cargo build -q --release --example vmcheck
    # --nic virtio: the virtio-net device, its capture, and its marks
    # (notifications of its unused receive queue).
    # --backend iommufd: the same, mapped through iommufd (VM_KERNEL=iommufd).
    # The device's address is passed only to a backend that takes one
    # (vfio or iommufd; the sweep refuses it with --backend soft), and
    # not over a --device of ARGS.
    dev=$bdf pcap="$vm/tx.pcap" nic=igb prev="" backend="--backend vfio" which=vfio own_dev=""
    for a in "$@"; do
        case "$prev,$a" in
        --nic,*) nic=$a ;;
        *,--nic=*) nic=${a#--nic=} ;;
        --backend,*) which=$a ;;
        *,--backend=*) which=${a#--backend=} ;;
        esac
        case "$a" in
        --backend | --backend=*) backend="" ;;
        --device | --device=*) own_dev=1 ;;
        esac
        prev=$a
    done
    if [ "$nic" = virtio ]; then dev=$vbdf pcap="$vm/virtio.pcap"; fi
    device="--device $dev"
    case "$which" in
    vfio | iommufd) [ -z "$own_dev" ] || device="" ;;
    *) device="" ;;
    esac
    # shellcheck disable=SC2086 # $backend and $device are two words or none
    pack "$bin" $backend $device --no-progress --csv /tmp/out.csv "$@"
    boot -d trace:vtd_inv_desc_iotlb_pages,trace:vtd_inv_desc_iotlb_domain,trace:vtd_inv_desc_iotlb_global,trace:vtd_iotlb_page_hit,trace:vtd_iotlb_page_update,trace:e1000e_core_write,trace:virtio_pci_notify_write \
        -D "$vm/trace.log"
    cat "$vm/console.log"
    "$cargo_target/release/examples/vmcheck" sweep --nic "$nic" --console "$vm/console.log" \
        --trace "$vm/trace.log" --pcap "$pcap" --out "$vm/sweep.csv"
    ;;
*)
    echo "usage: vm/run.sh test | sweep [SWEEP ARGS] | setup" >&2
    exit 2
    ;;
esac
