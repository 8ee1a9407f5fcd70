#!/usr/bin/env bash
# A sample host discovery script: lightning-elastic launch --host-discovery-script examples/discover_hosts.sh
#
# What the driver expects of a discovery script:
# - It is run with no arguments, in the driver's working directory, every
#   --discovery-interval seconds (1 by default), and must end within 30 s.
# - It prints the hosts available now on stdout, one HOST[:SLOTS] per line: SLOTS is how
#   many workers the host takes (its GPUs, say); a host without :SLOTS needs the driver's
#   --slots-per-host. Blank lines and lines starting with "#" are ignored; a host listed
#   twice is an error. Its stderr is kept for the driver's error message.
# - A host that appears gets workers (up to --max-np in all); the workers of a host that
#   disappears leave at their next check, with nothing rolled back.
# - A non-zero exit is a failed discovery: fatal on the first run (the job does not start),
#   later the hosts stay as last listed and the script is run again at the next interval.
#
# Where this one finds hosts, the first that applies:
# 1. Inside a Slurm allocation (SLURM_JOB_NODELIST is set): the allocation's nodes, each
#    with SLURM_NTASKS_PER_NODE slots (else SLOTS_PER_HOST, else 1).
# 2. Else a hosts file, HOSTS_FILE (default: hosts.txt in the working directory), in the
#    same HOST[:SLOTS] format, kept up to date by hand, a cron job or a cloud listing such
#    as (AWS, the instances of an auto-scaling group, 8 GPUs each):
#      aws ec2 describe-instances --filters Name=tag:aws:autoscaling:groupName,Values=train \
#          Name=instance-state-name,Values=running \
#          --query 'Reservations[].Instances[].PrivateDnsName' --output text | tr '\t' '\n' | sed 's/$/:8/'
#
# Try it on this machine (127.0.0.x are all this machine's addresses):
#   printf '127.0.0.1:1\n127.0.0.2:1\n' > hosts.txt
#   lightning-elastic launch -np 2 --min-np 1 --max-np 3 \
#       --host-discovery-script examples/discover_hosts.sh python examples/elastic_loop.py
#   echo 127.0.0.3:1 >> hosts.txt     # in another shell: a host joins the job
set -euo pipefail

if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    slots="${SLURM_NTASKS_PER_NODE:-${SLOTS_PER_HOST:-1}}"
    slots="${slots%%(*}"   # Slurm may write "4(x2)": 4 tasks on each of 2 nodes
    scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/:$slots/"
    exit 0
fi

hosts_file="${HOSTS_FILE:-hosts.txt}"
if [ ! -r "$hosts_file" ]; then
    echo "discover_hosts.sh: no hosts file $hosts_file (set HOSTS_FILE, or run inside a Slurm allocation)" >&2
    exit 1
fi
# The driver ignores comments and blank lines itself; dropping them here keeps the output
# short in --verbose logs. "|| true": a file of comments only lists no host, which is not an error.
grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$hosts_file" || true
