#!/bin/sh
# Host discovery for an elastic horovodrun: the hosts listed in a file that you edit while the job
# runs, one "host:slots" a line ("#" starts a comment). Add a line and workers start there at the
# next commit; remove one and its workers leave. The file: $HOSTS_FILE, else ./hosts.
#
#   HOSTS_FILE=$PWD/hosts horovodrun -np 4 --min-np 2 --max-np 8 \
#       --host-discovery-script examples/elastic/discover_hosts_file.sh python train.py
sed -e 's/#.*//' -e 's/[[:space:]]//g' "${HOSTS_FILE:-hosts}" | grep -v '^$'
