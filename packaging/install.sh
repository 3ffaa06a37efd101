#!/bin/sh
# Install the job controller as systemd services; run as root from a clone. Safe to run again:
# each step checks what is there, an existing /etc/controller/controller.json is kept.
#
#   packaging/install.sh [--workers N] [--job-users N] [--wheels DIR] [--no-start] [--prefix DIR]
#
# What it does, in order:
#   1. copies the product (controller/, worker/, gen/, packaging/, pyproject.toml, README.md)
#      to /opt/job-controller, the path the units name (nothing to copy when run from there);
#   2. builds /opt/job-controller/.venv from the system Python (/usr/bin/python3: a Python
#      under /root or /home cannot start under the units' ProtectHome=yes) and installs the
#      product into it, from the package index or, with --wheels DIR, offline from a
#      directory of wheels (PIP_* variables reach pip unchanged);
#   3. creates the user and group `controller` (sysusers.d) and /run/controller (tmpfiles.d);
#      and the job users controller-job-0 ... controller-job-N (sysusers.d: packaging/job-users.sh
#      writes /etc/sysusers.d/controller-jobs.conf; N: --job-users, default the larger of the CPU
#      count and --workers): worker@I runs its jobs as controller-job-I, `controller
#      --workers N` its slots' as controller-job-0 ... N-1. Each has a group of its own and no
#      other, no home (/) and no shell (nologin); none is ever removed;
#   4. installs /etc/controller/controller.json, 0600 root (an existing one is kept, and made
#      0600 root: it may hold a Redis password), and writes /etc/controller/http-tokens (one
#      random token, 0600 root) when it is missing: the packaged configuration names it as
#      http_token_file, and jobctl reads it by default;
#   5. installs controller.service, worker@.service and workers.target (with --prefix's
#      path in them), reloads systemd;
#   6. enables and starts controller.service and worker@1 ... worker@N (N: --workers, default
#      one per CPU), and stops and disables worker@ units above N. --no-start enables only,
#      and works where systemd is not running (an image being built).
set -eu
# The venv and the product are read by the workers' user: whatever the caller's umask.
umask 022

PREFIX=/opt/job-controller
PYTHON=/usr/bin/python3
WORKERS=
JOB_USERS=
WHEELS=
START=yes

say() { printf 'install.sh: %s\n' "$*"; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }
usage() {
    sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --workers) [ $# -ge 2 ] || die "--workers needs a number"; WORKERS=$2; shift 2 ;;
        --workers=*) WORKERS=${1#*=}; shift ;;
        --job-users) [ $# -ge 2 ] || die "--job-users needs a number"; JOB_USERS=$2; shift 2 ;;
        --job-users=*) JOB_USERS=${1#*=}; shift ;;
        --wheels) [ $# -ge 2 ] || die "--wheels needs a directory"; WHEELS=$2; shift 2 ;;
        --wheels=*) WHEELS=${1#*=}; shift ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
        --prefix=*) PREFIX=${1#*=}; shift ;;
        --no-start) START=no; shift ;;
        -h|--help) usage 0 ;;
        *) printf 'install.sh: unknown option %s\n' "$1" >&2; usage 2 ;;
    esac
done

[ "$(id -u)" = 0 ] || die "run me as root (sudo $0)"
if [ -z "$WORKERS" ]; then
    WORKERS=$(nproc)
fi
case "$WORKERS" in
    ''|*[!0-9]*) die "--workers takes a whole number, got '$WORKERS'" ;;
esac
# Job users for slots 0 ... N: worker@1 ... worker@WORKERS and `controller --workers` (0 ...).
if [ -z "$JOB_USERS" ]; then
    JOB_USERS=$(nproc)
    [ "$WORKERS" -le "$JOB_USERS" ] || JOB_USERS=$WORKERS
fi
case "$JOB_USERS" in
    ''|*[!0-9]*) die "--job-users takes a whole number, got '$JOB_USERS'" ;;
esac
[ "$JOB_USERS" -ge "$WORKERS" ] || die "--job-users $JOB_USERS is below --workers $WORKERS: worker@$WORKERS needs controller-job-$WORKERS"
if [ -n "$WHEELS" ]; then
    [ -d "$WHEELS" ] || die "--wheels $WHEELS: no such directory"
    WHEELS=$(cd "$WHEELS" && pwd)
fi
[ -x "$PYTHON" ] || die "$PYTHON not found: install python3 (3.11 or newer) and python3-venv"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is older than 3.11"
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null \
    || die "$PYTHON cannot make a venv: apt-get install python3-venv"
command -v systemctl >/dev/null 2>&1 || die "systemctl not found: this script needs systemd"
# Without a running systemd (an image being built, a chroot) only --no-start makes sense.
if [ -d /run/systemd/system ]; then
    RUNNING=yes
else
    RUNNING=no
    [ "$START" = no ] || die "systemd is not running here: use --no-start to install and enable only"
fi
case "$PREFIX" in
    /root/*|/home/*|/run/user/*) die "--prefix $PREFIX: the units' ProtectHome=yes hides it" ;;
    /*) ;;
    *) die "--prefix must be an absolute path" ;;
esac

SRC=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$SRC/pyproject.toml" ] && [ -d "$SRC/controller" ] || die "run me from a clone: $SRC is not one"

# 1. The product where the units expect it.
if [ "$SRC" != "$(mkdir -p "$PREFIX" && cd "$PREFIX" && pwd)" ]; then
    say "copying the product from $SRC to $PREFIX"
    for item in controller worker gen packaging; do
        rm -rf "${PREFIX:?}/$item"
        cp -R "$SRC/$item" "$PREFIX/$item"
    done
    for item in pyproject.toml README.md; do
        cp "$SRC/$item" "$PREFIX/$item"
    done
    find "$PREFIX" -name __pycache__ -prune -exec rm -rf {} +
fi
chmod -R u=rwX,go=rX "$PREFIX/controller" "$PREFIX/worker" "$PREFIX/gen" "$PREFIX/packaging"

# 2. The venv, from the system Python (rebuilt when it was made from another one).
VENV=$PREFIX/.venv
if [ -f "$VENV/pyvenv.cfg" ] && ! grep -qx "home = $(dirname "$PYTHON")" "$VENV/pyvenv.cfg"; then
    say "$VENV was made from $(sed -n 's/^home = //p' "$VENV/pyvenv.cfg"), not $PYTHON: rebuilding it"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV from $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
if [ -n "$WHEELS" ]; then
    say "installing the product into $VENV from $WHEELS (offline)"
    set -- --no-index --find-links "$WHEELS"
else
    say "installing the product into $VENV"
    set --
fi
(cd "$PREFIX" && "$VENV/bin/pip" install --quiet --disable-pip-version-check \
    --no-cache-dir "$@" "$PREFIX") || die "pip could not install the product (see above)"
"$VENV/bin/controller" --version >/dev/null || die "$VENV/bin/controller does not run"

# 3. The user and group, the socket directory.
install -D -m 0644 "$SRC/packaging/controller.sysusers" /etc/sysusers.d/controller.conf
systemd-sysusers /etc/sysusers.d/controller.conf
getent group controller >/dev/null || die "systemd-sysusers did not create group controller"
# The job users: a group of its own each and no other (never `controller`, whose group
# reaches main.sock and the socket directory), no home, no shell.
jobs_conf=/etc/sysusers.d/controller-jobs.conf
sh "$SRC/packaging/job-users.sh" "$JOB_USERS" >"$jobs_conf.new"
chmod 0644 "$jobs_conf.new"
mv -f "$jobs_conf.new" "$jobs_conf"
systemd-sysusers "$jobs_conf"
i=0
while [ "$i" -le "$JOB_USERS" ]; do
    groups=$(id -nG "controller-job-$i" 2>/dev/null) || die "systemd-sysusers did not create user controller-job-$i"
    [ "$groups" = "controller-job-$i" ] \
        || die "user controller-job-$i is in the groups '$groups': a job user must be in its own group alone"
    i=$((i + 1))
done
say "job users controller-job-0 ... controller-job-$JOB_USERS are there"
install -D -m 0644 "$SRC/packaging/controller.tmpfiles" /etc/tmpfiles.d/controller.conf
systemd-tmpfiles --create /etc/tmpfiles.d/controller.conf

# 4. The configuration: root's alone (it may name a token file or hold a Redis password).
install -d -m 0700 -o root -g root /etc/controller
if [ -e /etc/controller/controller.json ]; then
    say "keeping the existing /etc/controller/controller.json (root's alone, 0600)"
    chown root:root /etc/controller/controller.json
    chmod 0600 /etc/controller/controller.json
else
    install -m 0600 -o root -g root "$SRC/packaging/controller.json" /etc/controller/controller.json
    say "installed /etc/controller/controller.json"
fi
# The HTTP API's token: one random token, root's alone, written only when there is none.
TOKENS=/etc/controller/http-tokens
if [ -e "$TOKENS" ] || [ -L "$TOKENS" ]; then
    say "keeping the existing token file $TOKENS"
else
    token=$("$VENV/bin/python" -c 'import secrets; print(secrets.token_urlsafe(32))') \
        || die "could not make a token"
    (
        umask 077
        printf '# The HTTP API and console tokens, one a line (jobctl sends the first).\n%s\n' \
            "$token" >"$TOKENS.new"
    )
    chown root:root "$TOKENS.new"
    chmod 0600 "$TOKENS.new"
    mv -f "$TOKENS.new" "$TOKENS"
    say "wrote a new HTTP API token to $TOKENS (root's alone): jobctl reads it from there, the console asks for it"
fi
named=$("$VENV/bin/python" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("http_token_file") or "")' \
    /etc/controller/controller.json 2>/dev/null) || named=
if [ "$named" != "$TOKENS" ]; then
    say "note: /etc/controller/controller.json does not name $TOKENS as http_token_file (it names '${named:-nothing}')"
fi

# 5. The units; a running controller is restarted below, on what was just installed.
was_active=no
if [ "$RUNNING" = yes ] && systemctl is-active --quiet controller.service; then
    was_active=yes
fi
for unit in controller.service worker@.service workers.target; do
    # The units name /opt/job-controller; another --prefix is written into them.
    sed "s#/opt/job-controller#$PREFIX#g" "$SRC/packaging/$unit" >"/etc/systemd/system/$unit.new"
    chmod 0644 "/etc/systemd/system/$unit.new"
    mv -f "/etc/systemd/system/$unit.new" "/etc/systemd/system/$unit"
done
if [ "$RUNNING" = yes ]; then
    systemctl daemon-reload
fi

# 6. Enable (and start) the controller and one worker per CPU; retire workers above N.
units="controller.service workers.target"
i=1
while [ "$i" -le "$WORKERS" ]; do
    units="$units worker@$i.service"
    i=$((i + 1))
done
for link in /etc/systemd/system/workers.target.wants/worker@*.service; do
    [ -e "$link" ] || [ -L "$link" ] || continue
    n=${link##*/worker@}
    n=${n%.service}
    case "$n" in
        ''|*[!0-9]*) continue ;;
    esac
    if [ "$n" -gt "$WORKERS" ]; then
        say "retiring worker@$n.service (more than $WORKERS workers)"
        if [ "$RUNNING" = yes ]; then
            systemctl disable --now "worker@$n.service"
        else
            systemctl disable "worker@$n.service"
        fi
    fi
done
if [ "$START" = yes ]; then
    # shellcheck disable=SC2086
    systemctl enable --now $units
    if [ "$was_active" = yes ]; then
        say "restarting the controller and its workers on what was just installed"
        # shellcheck disable=SC2086
        systemctl restart $units
    fi
    if systemctl is-active --quiet controller.service; then
        say "controller.service is running, with worker@1 ... worker@$WORKERS"
    else
        die "controller.service did not start: journalctl -u controller.service"
    fi
    say "try: $VENV/bin/udp-client add 5 --payload hi"
else
    # shellcheck disable=SC2086
    systemctl enable $units
    say "enabled controller.service and $WORKERS workers; start them with: systemctl start controller.service workers.target"
fi
