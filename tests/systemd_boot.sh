#!/bin/sh
# PID 1 of fresh pid, mount, uts, ipc, net and cgroup namespaces (tests/test_systemd.py starts
# it under unshare): makes a throwaway machine out of this one, then becomes systemd.
#
# Nothing it does reaches the host: mounts are private, /etc, /var and /opt are overlays whose
# upper halves live on a tmpfs, /tmp and /run are new tmpfs (checked before systemd starts:
# Debian's tmpfiles empties /tmp at boot), the network namespace has only loopback.
#
# Environment: JC_STAGE (an empty directory for the staging tmpfs), JC_CLONE (the project to
# install, bound at /opt/jc-clone), JC_WHEELS (wheels, bound at /opt/jc-wheels), JC_MARKER (a
# file in the host's /tmp that must not be visible here).
set -eu
: "${JC_STAGE:?}" "${JC_CLONE:?}" "${JC_WHEELS:?}" "${JC_MARKER:?}"

mount --make-rprivate /
mount -t tmpfs -o mode=0700 jcstage "$JC_STAGE"
for d in etc var opt; do
    mkdir -p "$JC_STAGE/$d/u" "$JC_STAGE/$d/w"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$JC_STAGE/$d/u,workdir=$JC_STAGE/$d/w" "/$d"
done
mkdir -p /opt/jc-clone /opt/jc-wheels
mount --bind "$JC_CLONE" /opt/jc-clone
mount --bind "$JC_WHEELS" /opt/jc-wheels

# Only what this test boots: no host service starts, nothing that needs hardware.
rm -rf /etc/systemd/system/*.wants /etc/systemd/system/controller.service \
    /etc/systemd/system/worker@.service /etc/systemd/system/workers.target
for unit in systemd-udevd.service systemd-udev-trigger.service systemd-udev-settle.service \
    systemd-udevd-control.socket systemd-udevd-kernel.socket systemd-sysctl.service \
    systemd-modules-load.service systemd-binfmt.service proc-sys-fs-binfmt_misc.automount \
    kmod-static-nodes.service systemd-remount-fs.service systemd-pstore.service \
    systemd-timesyncd.service systemd-firstboot.service systemd-repart.service \
    systemd-hwdb-update.service sys-kernel-debug.mount sys-kernel-tracing.mount \
    sys-kernel-config.mount sys-fs-fuse-connections.mount dev-hugepages.mount \
    systemd-pcrphase.service systemd-pcrphase-sysinit.service \
    systemd-pcrphase-initrd.service getty@tty1.service console-getty.service \
    systemd-logind.service systemd-tmpfiles-clean.timer; do
    ln -sf /dev/null "/etc/systemd/system/$unit"
done
cat > /etc/systemd/system/jctest.target <<'EOF'
[Unit]
Description=The job controller's systemd test
Requires=basic.target
After=basic.target
Wants=systemd-journald.service
EOF

umount -l /dev
mount -t tmpfs -o mode=0755,nosuid dev /dev
mknod -m 0666 /dev/null c 1 3
mknod -m 0666 /dev/zero c 1 5
mknod -m 0666 /dev/full c 1 7
mknod -m 0666 /dev/random c 1 8
mknod -m 0666 /dev/urandom c 1 9
mknod -m 0666 /dev/tty c 5 0
mkdir -p /dev/pts /dev/shm /dev/mqueue
mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
ln -s pts/ptmx /dev/ptmx
mount -t tmpfs -o mode=1777,nosuid,nodev shm /dev/shm
mount -t mqueue mqueue /dev/mqueue
ln -s /proc/self/fd /dev/fd
ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout
ln -s /proc/self/fd/2 /dev/stderr

umount -l /proc
mount -t proc proc /proc
mount --bind /proc/sys /proc/sys
mount -o remount,bind,ro /proc/sys

umount -R /sys/fs/cgroup
mount -o remount,bind,ro /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup

umount -l "$JC_STAGE"
mount -t tmpfs -o mode=1777,nosuid,nodev jctmp /tmp
mount -t tmpfs -o mode=0755,nosuid,nodev jcrun /run

# Refuse to boot unless /tmp and /run are this namespace's own: systemd-tmpfiles would empty
# the host's /tmp otherwise.
for d in /tmp /run; do
    fstype=$(findmnt -n -o FSTYPE --mountpoint "$d" || true)
    if [ "$fstype" != tmpfs ]; then
        echo "jctest: $d is not a tmpfs of its own ($fstype): not booting" >&2
        exit 1
    fi
done
if [ -e "/tmp/$JC_MARKER" ] || [ -n "$(ls -A /tmp)" ] || [ -n "$(ls -A /run)" ]; then
    echo "jctest: /tmp or /run is not empty: the host's shows through: not booting" >&2
    exit 1
fi
echo "jctest: /tmp and /run are private tmpfs"

hostname jctest
ip link set lo up
exec env -i container=jctest PATH=/usr/sbin:/usr/bin:/sbin:/bin /lib/systemd/systemd \
    --system --unit=jctest.target --log-target=journal-or-kmsg
