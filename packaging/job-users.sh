#!/bin/sh
# Print the sysusers.d(5) lines of the job users controller-job-0 ... controller-job-N
# (packaging/install.sh writes them to /etc/sysusers.d/controller-jobs.conf):
#
#   packaging/job-users.sh N
#
# worker@I.service runs its --exec jobs as controller-job-I, `controller --workers N` its slots'
# as controller-job-0 ... N-1 (config "job_users": "controller-job-{slot}"). Each is a system
# user with a group of its own and no other (never `controller`, whose group reaches main.sock
# and the socket directory), no home directory (/) and no shell (nologin).
set -eu
[ $# -eq 1 ] || { echo "usage: $0 N" >&2; exit 2; }
case "$1" in
    ''|*[!0-9]*) echo "$0: N must be a whole number, got '$1'" >&2; exit 2 ;;
esac
echo "# sysusers.d(5), written by packaging/install.sh: the users the workers run jobs as."
echo "# worker@I.service runs its jobs as controller-job-I; each has a group of its own alone."
i=0
while [ "$i" -le "$1" ]; do
    echo "u controller-job-$i - \"Jobs of job controller worker slot $i\" / /usr/sbin/nologin"
    i=$((i + 1))
done
