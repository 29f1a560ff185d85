#!/bin/bash
# Host discovery for an elastic horovodrun inside a Slurm allocation: the allocation's nodes that
# Slurm reports usable, each with $SLOTS_PER_NODE slots (default: $SLURM_NTASKS_PER_NODE, else 1).
# A node that goes down, fails or is drained leaves the job; when it is back it joins again.
#
#   horovodrun -np "$SLURM_NTASKS" --min-np 2 --max-np "$SLURM_NTASKS" \
#       --host-discovery-script examples/elastic/discover_hosts_slurm.sh python train.py
set -euo pipefail
slots="${SLOTS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}"
slots="${slots%%(*}"  # Slurm writes "2(x3)" for 2 tasks on each of 3 nodes
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
  state="$(sinfo --noheader --nodes="$node" --format=%t 2>/dev/null | head -n 1)"
  case "$state" in
    ""|*"*"*|down*|drain*|drng*|fail*|maint*|unk*|boot*|powered*|power_down*) continue ;;  # "*": not responding
  esac
  echo "$node:$slots"
done
