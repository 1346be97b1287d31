#!/usr/bin/env bash
# Emulated two-node cluster on one machine: two network namespaces joined by a
# rate-limited veth pair. Ranks inside a namespace talk over loopback (the
# "intra-node" link, unshaped); traffic between namespaces crosses the veth
# pair, shaped with tbf (the "inter-node" link).
#
#   bench/cluster.sh up [RATE]          create (RATE default 1gbit, any tc rate)
#   bench/cluster.sh down               remove
#   bench/cluster.sh run [RATE] -- CMD  up, run CMD once per node, down (also on Ctrl-C)
#   bench/cluster.sh exec -- CMD        run CMD once per node on a cluster that is up
#   bench/cluster.sh bytes              bytes sent by each node over the veth pair
#
# CMD runs inside each namespace with NODE_RANK, NNODES, MASTER_ADDR and
# GLOO_SOCKET_IFNAME set; typically
#   torchrun --nnodes=$NNODES --nproc_per_node=2 --node_rank=$NODE_RANK \
#            --master_addr=$MASTER_ADDR --master_port=29511 script.py
# (single-quote CMD so the variables expand inside each namespace).
set -euo pipefail

NS=(fgpsdp-node0 fgpsdp-node1)
VETH=(fgpsdp-veth0 fgpsdp-veth1)
ADDR=(10.213.77.1 10.213.77.2)

die() { echo "cluster.sh: $*" >&2; exit 1; }

preflight() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces and tc); run as root or with sudo"
  command -v ip >/dev/null || die "'ip' (iproute2) not found"
  command -v tc >/dev/null || die "'tc' (iproute2) not found"
  ip netns add fgpsdp-probe 2>/dev/null || die "cannot create network namespaces here"
  ip netns del fgpsdp-probe
}

down() {
  for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}

up() {
  local rate="${1:-1gbit}"
  preflight
  down
  for i in 0 1; do ip netns add "${NS[$i]}"; done
  ip link add "${VETH[0]}" type veth peer name "${VETH[1]}"
  for i in 0 1; do
    ip link set "${VETH[$i]}" netns "${NS[$i]}"
    ip -n "${NS[$i]}" addr add "${ADDR[$i]}/30" dev "${VETH[$i]}"
    ip -n "${NS[$i]}" link set lo up
    ip -n "${NS[$i]}" link set "${VETH[$i]}" up
    # Egress shaping on each side: the link is rate-limited in both directions.
    ip netns exec "${NS[$i]}" tc qdisc add dev "${VETH[$i]}" root tbf \
      rate "$rate" burst 256kb latency 50ms
  done
  ip -n "${NS[0]}" route get "${ADDR[1]}" >/dev/null 2>&1 || die "nodes cannot reach each other"
  echo "cluster up: 2 nodes, inter-node rate $rate (${ADDR[0]} <-> ${ADDR[1]})"
}

bytes() {
  for i in 0 1; do
    local tx
    tx=$(ip netns exec "${NS[$i]}" cat "/sys/class/net/${VETH[$i]}/statistics/tx_bytes")
    echo "node$i tx_bytes $tx"
  done
}

on_nodes() {
  # Runs "$*" in both namespaces at once; fails if either fails.
  local pids=() rc=0
  for i in 0 1; do
    ip netns exec "${NS[$i]}" env NODE_RANK="$i" NNODES=2 MASTER_ADDR="${ADDR[0]}" \
      GLOO_SOCKET_IFNAME="${VETH[$i]}" bash -c "$*" &
    pids+=($!)
  done
  trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  return $rc
}

run() {
  local rate="1gbit"
  if [ "${1:-}" != "--" ]; then rate="$1"; shift; fi
  [ "${1:-}" = "--" ] || die "usage: cluster.sh run [RATE] -- CMD"
  shift
  [ $# -gt 0 ] || die "no command given"
  up "$rate"
  trap 'down' EXIT
  trap 'down; exit 130' INT TERM
  local rc=0
  on_nodes "$@" || rc=$?
  bytes
  return $rc
}

exec_on_up() {
  [ "${1:-}" = "--" ] || die "usage: cluster.sh exec -- CMD"
  shift
  ip netns list | grep -q "${NS[0]}" || die "cluster is not up (bench/cluster.sh up)"
  on_nodes "$@"
}

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down; echo "cluster down" ;;
  run) shift; run "$@" ;;
  exec) shift; exec_on_up "$@" ;;
  bytes) bytes ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
