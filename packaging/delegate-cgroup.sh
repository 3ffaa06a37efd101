#!/bin/sh
# worker@.service's ExecStartPre=, as root before the worker starts: hand the unit's
# delegated cgroup v2 directory (Delegate=yes) to the user the worker runs as, as systemd
# itself does for a unit with User=: the directory, its cgroup.procs, cgroup.threads and
# cgroup.subtree_control. The worker starts as root and switches to that user (--user);
# there it makes a cgroup per job. Without a cgroup v2 directory of a worker@ unit to hand
# over (cgroup v1 only, or started by hand) it does nothing.
#
#   packaging/delegate-cgroup.sh USER
set -eu
[ $# -eq 1 ] || { echo "usage: $0 USER" >&2; exit 2; }
user=$1
own=$(sed -n 's/^0:://p' /proc/self/cgroup)
case "$own" in
    */worker@*.service) ;;
    *) exit 0 ;;  # not a worker@ unit's own cgroup: never hand over anything else
esac
for mount in /sys/fs/cgroup /sys/fs/cgroup/unified; do
    [ -f "$mount/cgroup.controllers" ] || continue
    dir=$mount$own
    [ -d "$dir" ] || exit 0
    chown "$user:" "$dir" "$dir/cgroup.procs" "$dir/cgroup.threads" "$dir/cgroup.subtree_control"
    exit 0
done
