#!/bin/sh
# The --exec job of `python -m bench.peers --lengths`, for our workers and Gearman's command
# worker alike: one line on stdin, `sleep SECONDS` or `busy ITERATIONS` (a shell loop, no
# other process; bench/peers_lengths.py counts the iterations that last the job's length).
read -r kind arg
case $kind in
sleep) exec sleep "$arg" ;;
busy)
    i=0
    while [ "$i" -lt "$arg" ]; do i=$((i + 1)); done
    ;;
*)
    echo "unknown job: $kind" >&2
    exit 2
    ;;
esac
