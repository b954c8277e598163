#!/usr/bin/env bash
# Local OpenSearch for development and CI, built only from Maven artifacts (no Docker).
#
#   opensearch.sh fetch                 resolve + unpack + install k-NN (cached, idempotent)
#   opensearch.sh start [options]       start 1 or 2 nodes on 127.0.0.1, wait for health
#   opensearch.sh stop  [options]       stop them (SIGTERM, then SIGKILL after a grace period)
#   opensearch.sh status [options]      print state; exit 0 when running, 3 when not
#   opensearch.sh url   [options]       print the http URL of node 0
#
# Version choice (measured here: 2 cores, 24 GB, Java 17 + Temurin 25):
#   DEFAULT 3.6.0 + opensearch-knn 3.6.0.0 -- the newest pair that resolves from Maven and
#   runs. 3.x needs Java >= 21: the script picks the newest suitable JDK it finds (Temurin 25
#   here) when the default java is 17. Cold start to green: ~17s (1 node), ~19s (2 nodes);
#   ~9s warm; RSS ~0.8 GB per node with the default 1g heap.
#   NOT 2.19.x: the 2.19.x integ-test zips on Maven carry only the transport-netty4 module
#   (no analysis-common, so no `cjk` analyzer; no lang-painless, so the k-NN install fails
#   with "Missing plugin [lang-painless]"), and lang-painless 2.19.6 is not published as a
#   zip. 2.x also cannot run on Java >= 24 (Security Manager); with OPENSEARCH_VERSION=2.x the
#   script picks a JDK 11..23.
# The Maven k-NN zip ships no native libraries: mappings must use `engine: lucene`.
#
# Options (env in brackets):
#   --version V     [OPENSEARCH_VERSION]   OpenSearch version (k-NN plugin = V.0)
#   --port P        [OPENSEARCH_PORT]      http port of node 0 (default 9200); node i uses P+i,
#                                          transport port P+100+i
#   --nodes N       [OPENSEARCH_NODES]     1 (single-node) or 2 (loopback cluster; node 0 is the
#                                          only cluster-manager, node 1 holds data only, so
#                                          node 1 can be stopped in failover tests)
#   --data-dir D    [OPENSEARCH_DATA_DIR]  data root (node i uses D/node-i); default: a temp dir
#                                          that `stop` removes
#   --heap H        [OPENSEARCH_HEAP]      max heap per node (default 1g; Xms 512m)
#   --timeout S     [OPENSEARCH_START_TIMEOUT] seconds to wait for health (default 180)
#   --node I        stop (or start again) just node I of a running cluster: failover tests
# Other env: OPENSEARCH_CACHE_DIR (default ~/.cache/retrieval-opensearch),
#   OPENSEARCH_JAVA_HOME (force a JDK), OPENSEARCH_RUN_AS (user for the JVM when run as root;
#   OpenSearch refuses to run as root; default nobody), OPENSEARCH_PORT_WAIT_S (how long a
#   start waits for a busy port to free, e.g. from a JVM still exiting; default 30).
# Security is off: the integ-test distribution has no security plugin. Loopback only.

set -euo pipefail

DEFAULT_VERSION="3.6.0"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "opensearch.sh: $*" >&2; exit 1; }
log() { echo "opensearch.sh: $*" >&2; }

CMD="${1:-}"; [[ $# -gt 0 ]] && shift
VERSION="${OPENSEARCH_VERSION:-$DEFAULT_VERSION}"
PORT="${OPENSEARCH_PORT:-9200}"
NODES="${OPENSEARCH_NODES:-1}"
DATA_DIR="${OPENSEARCH_DATA_DIR:-}"
HEAP="${OPENSEARCH_HEAP:-1g}"
START_TIMEOUT="${OPENSEARCH_START_TIMEOUT:-180}"
ONLY_NODE=""
NODES_GIVEN="${OPENSEARCH_NODES:+1}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --version) VERSION="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --nodes) NODES="$2"; NODES_GIVEN=1; shift 2 ;;
    --data-dir) DATA_DIR="$2"; shift 2 ;;
    --heap) HEAP="$2"; shift 2 ;;
    --timeout) START_TIMEOUT="$2"; shift 2 ;;
    --node) ONLY_NODE="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1" ;;
  esac
done
[[ "$NODES" == 1 || "$NODES" == 2 ]] || die "--nodes must be 1 or 2"
[[ "$PORT" =~ ^[0-9]+$ ]] || die "--port must be a number"

KNN_VERSION="${VERSION}.0"
MAJOR="${VERSION%%.*}"
CACHE_DIR="${OPENSEARCH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/retrieval-opensearch}"
INSTALL_DIR="$CACHE_DIR/opensearch-$VERSION-knn"
# Root's home is usually mode 700, and the JVM runs as an unprivileged user when we are root,
# so node state (config copy, logs, pid files) then lives under /var/tmp instead.
if [[ "$(id -u)" == 0 ]]; then STATE_BASE="/var/tmp/retrieval-opensearch"; else STATE_BASE="$CACHE_DIR"; fi
RUN_DIR="$STATE_BASE/run/$PORT"
M2_REPO="${M2_REPO:-$HOME/.m2/repository}"
URL="http://127.0.0.1:$PORT"

# ---------------------------------------------------------------------------------- fetch
m2_path() {  # group artifact version -> path of the zip in the local Maven repository
  echo "$M2_REPO/${1//.//}/$2/$3/$2-$3.zip"
}

mvn_get() {  # group:artifact:version:zip into ~/.m2 (a no-op when already cached)
  local g="$1" a="$2" v="$3" f
  f="$(m2_path "$g" "$a" "$v")"
  if [[ ! -s "$f" ]]; then
    command -v mvn >/dev/null || die "maven (mvn) is needed to fetch $g:$a:$v"
    log "resolving $g:$a:$v:zip with Maven"
    mvn -q -B dependency:get -Dartifact="$g:$a:$v:zip" -Dtransitive=false >&2 \
      || die "could not resolve $g:$a:$v:zip"
  fi
  [[ -s "$f" ]] || die "resolved $g:$a:$v but $f is missing"
  echo "$f"
}

java_major() {  # JDK dir -> major version (from its release file), or empty
  local rel="$1/release"
  [[ -x "$1/bin/java" && -f "$rel" ]] || return 0
  sed -n 's/^JAVA_VERSION="\([0-9]*\).*/\1/p' "$rel"
}

java_ok() {  # major -> 0 if this OpenSearch major can run on it
  local m="$1"
  [[ -n "$m" ]] || return 1
  if (( MAJOR >= 3 )); then (( m >= 21 )); else (( m >= 11 && m <= 23 )); fi
}

pick_java() {  # echo a JDK home suitable for $VERSION
  if [[ -n "${OPENSEARCH_JAVA_HOME:-}" ]]; then echo "$OPENSEARCH_JAVA_HOME"; return; fi
  local cands=() d best="" bestm=0 m
  [[ -n "${JAVA_HOME:-}" ]] && cands+=("$JAVA_HOME")
  for d in /usr/lib/jvm/* /opt/* /opt/java/* /usr/local/*jdk* /usr/java/*; do
    [[ -d "$d" ]] && cands+=("$(readlink -f "$d")")
  done
  for d in "${cands[@]}"; do
    m="$(java_major "$d")"
    if java_ok "$m" && (( m > bestm )); then best="$d"; bestm="$m"; fi
  done
  [[ -n "$best" ]] || die "no JDK found for OpenSearch $VERSION (3.x needs >= 21, 2.x needs 11..23); set OPENSEARCH_JAVA_HOME"
  echo "$best"
}

do_fetch() {
  if [[ -x "$INSTALL_DIR/bin/opensearch" && -f "$INSTALL_DIR/.installed" ]]; then
    echo "$INSTALL_DIR"; return
  fi
  local dist knn java tmp
  dist="$(mvn_get org.opensearch.distribution.integ-test-zip opensearch "$VERSION")"
  knn="$(mvn_get org.opensearch.plugin opensearch-knn "$KNN_VERSION")"
  java="$(pick_java)"
  mkdir -p "$CACHE_DIR"
  tmp="$(mktemp -d "$CACHE_DIR/.unpack.XXXXXX")"
  # A global for the EXIT trap: it fires after this function returned, when the local is
  # gone (under `set -u` that made a first, uncached fetch exit non-zero).
  FETCH_TMP="$tmp"
  trap 'rm -rf "${FETCH_TMP:-}"' EXIT  # do_fetch runs in $(...): a subshell
  unzip -q "$dist" -d "$tmp"
  local home="$tmp/opensearch-$VERSION"
  [[ -x "$home/bin/opensearch" ]] || die "unexpected layout in $dist"
  log "installing k-NN $KNN_VERSION (java $(java_major "$java"))"
  OPENSEARCH_JAVA_HOME="$java" JAVA_HOME="$java" \
    "$home/bin/opensearch-plugin" install --batch "file://$knn" >"$tmp/plugin-install.log" 2>&1 \
    || { cat "$tmp/plugin-install.log" >&2; die "k-NN plugin install failed"; }
  touch "$home/.installed"
  rm -rf "$INSTALL_DIR"
  mv "$home" "$INSTALL_DIR"
  echo "$INSTALL_DIR"
}

# ---------------------------------------------------------------------------------- helpers
node_pid() {  # node index -> live pid or empty
  local f="$RUN_DIR/node-$1.pid" p
  [[ -f "$f" ]] || return 0
  p="$(tr -dc 0-9 <"$f")"
  # A killed JVM may linger as a zombie until reaped: that is no live node.
  if [[ -n "$p" ]] && kill -0 "$p" 2>/dev/null && [[ "$(ps -o stat= -p "$p" 2>/dev/null)" != Z* ]]; then echo "$p"; fi
}

health() {  # port [query] -> health json or fail
  curl -fsS --max-time "${3:-5}" "http://127.0.0.1:$1/_cluster/health${2:-}" 2>/dev/null
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A JVM just killed still holds its ports while its threads exit: its main thread already
# reads as a zombie (so it is no live node of ours), but the sockets close with the last
# thread, seconds later on a loaded machine. Seen in CI: a start right after a SIGKILL
# found the port busy. So a busy port gets that long to free before it counts as foreign.
port_free_within() {  # port seconds
  local n
  for ((n = 0; n < $2 * 4; n++)); do port_busy "$1" || return 0; sleep 0.25; done
  return 1
}

run_as_prefix() {  # OpenSearch refuses to run as root: drop to an unprivileged user
  if [[ "$(id -u)" != 0 ]]; then return; fi
  local u="${OPENSEARCH_RUN_AS:-nobody}" g
  g="$(id -gn "$u")"
  echo "setpriv --reuid=$u --regid=$g --clear-groups --"
}

runtime_home() {  # a home the JVM user can read (root's ~ is usually mode 700)
  local prefix="$1"
  if [[ -z "$prefix" ]] || $prefix test -r "$INSTALL_DIR/lib" 2>/dev/null; then
    echo "$INSTALL_DIR"; return
  fi
  local mirror="$STATE_BASE/opensearch-$VERSION-knn"
  if [[ ! -f "$mirror/.installed" ]]; then
    mkdir -p "$STATE_BASE" && chmod 755 "$STATE_BASE"
    rm -rf "$mirror"
    cp -al "$INSTALL_DIR" "$mirror" 2>/dev/null || cp -a "$INSTALL_DIR" "$mirror"
    chmod -R a+rX "$mirror"
  fi
  echo "$mirror"
}

print_running() {
  local i p pids=()
  for ((i = 0; i < NODES; i++)); do p="$(node_pid "$i")"; pids+=("${p:-?}"); done
  echo "url: $URL"
  echo "pids: ${pids[*]}"
  echo "run-dir: $RUN_DIR"
}

# ---------------------------------------------------------------------------------- start
start_node() {  # index home java prefix data_root
  local i="$1" home="$2" java="$3" prefix="$4" data_root="$5"
  local http=$((PORT + i)) tport=$((PORT + 100 + i))
  local nd="$RUN_DIR/node-$i" conf="$RUN_DIR/node-$i/config"
  kill_strays "$i"
  port_free_within "$http" "${OPENSEARCH_PORT_WAIT_S:-30}" || die "port $http is in use by something that is not ours"
  port_free_within "$tport" "${OPENSEARCH_PORT_WAIT_S:-30}" || die "transport port $tport is in use"
  rm -rf "$conf"; mkdir -p "$conf" "$nd/logs" "$data_root/node-$i"
  cp -r "$home/config/." "$conf/"
  # Per-node JVM files: GC log and heap dumps go to the node dir, not the (shared) home.
  sed -i -e "s#file=logs/gc.log#file=$nd/logs/gc.log#" \
         -e "s#HeapDumpPath=data#HeapDumpPath=$nd#" \
         -e "s#ErrorFile=logs/#ErrorFile=$nd/logs/#" \
         -e '/^-Xm[sx]/d' "$conf/jvm.options"
  printf -- '-Xms512m\n-Xmx%s\n' "$HEAP" >"$conf/jvm.options.d/heap.options"
  {
    echo "cluster.name: retrieval-local-$PORT"
    echo "node.name: node-$i"
    echo "network.host: 127.0.0.1"
    echo "http.port: $http"
    echo "transport.port: $tport"
    echo "path.data: $data_root/node-$i"
    echo "path.logs: $nd/logs"
    # Local disks are often nearly full; never turn indices read-only under a test run.
    echo "cluster.routing.allocation.disk.threshold_enabled: false"
    echo "action.destructive_requires_name: false"
    if [[ "$NODES" == 1 ]]; then
      echo "discovery.type: single-node"
    else
      echo "discovery.seed_hosts: [\"127.0.0.1:$((PORT + 100))\", \"127.0.0.1:$((PORT + 101))\"]"
      echo "cluster.initial_cluster_manager_nodes: [\"node-0\"]"
      if [[ "$i" == 0 ]]; then echo "node.roles: [cluster_manager, data, ingest]"
      else echo "node.roles: [data, ingest]"; fi
    fi
  } >"$conf/opensearch.yml"
  if [[ -n "$prefix" ]]; then
    chown -R "${OPENSEARCH_RUN_AS:-nobody}" "$nd" "$data_root/node-$i"
  fi
  # Both pid files go: the JVM's own one survives a node that was killed with its session
  # (SIGKILL runs no cleanup), and copy_pid would read that stale pid as this node's and
  # judge the new node dead at once (the CI failure of a 2-node start after a killed run).
  rm -f "$RUN_DIR/node-$i.pid" "$nd/opensearch.pid"
  # -d daemonizes; -p writes the JVM pid once it is up.
  (cd "$nd" && env OPENSEARCH_JAVA_HOME="$java" JAVA_HOME="$java" OPENSEARCH_PATH_CONF="$conf" \
      OPENSEARCH_JAVA_OPTS="${OPENSEARCH_EXTRA_JAVA_OPTS:-}" \
      $prefix "$home/bin/opensearch" -d -p "$nd/opensearch.pid" >"$nd/stdout.log" 2>&1) \
    || { tail -30 "$nd/stdout.log" >&2; die "node-$i failed to start (see $nd)"; }
}

START_T0="$(date +%s.%N)"

start_single() {  # (re)start node $ONLY_NODE of an existing cluster, keeping its data
  [[ -f "$RUN_DIR/nodes" ]] || die "no cluster on port $PORT to add node $ONLY_NODE to"
  NODES="$(cat "$RUN_DIR/nodes")"
  (( ONLY_NODE < NODES )) || die "--node $ONLY_NODE: the cluster has $NODES node(s)"
  if [[ -n "$(node_pid "$ONLY_NODE")" ]]; then log "node-$ONLY_NODE already running"; print_running; return; fi
  local home java prefix data_root
  home="$(do_fetch)"; java="$(pick_java)"; prefix="$(run_as_prefix)"; home="$(runtime_home "$prefix")"
  if [[ -f "$RUN_DIR/dataroot" ]]; then data_root="$(cat "$RUN_DIR/dataroot")"
  elif [[ -f "$RUN_DIR/tempdata" ]]; then data_root="$(cat "$RUN_DIR/tempdata")"
  elif [[ -n "$DATA_DIR" ]]; then data_root="$DATA_DIR"
  else die "unknown data dir for port $PORT: pass --data-dir"; fi
  start_node "$ONLY_NODE" "$home" "$java" "$prefix" "$data_root"
  wait_healthy "$java"
}

wait_healthy() {  # java -- wait until NODES nodes joined and health is yellow or green
  local deadline=$(( $(date +%s) + START_TIMEOUT )) ok=0 i t1
  while (( $(date +%s) < deadline )); do
    for ((i = 0; i < NODES; i++)); do copy_pid "$i"; done
    for ((i = 0; i < NODES; i++)); do
      if [[ -f "$RUN_DIR/node-$i.pid" && -z "$(node_pid "$i")" ]]; then
        tail -30 "$RUN_DIR/node-$i/stdout.log" >&2; deadline=0
      fi
    done
    if health "$PORT" "?wait_for_status=yellow&wait_for_nodes=$NODES&timeout=2s" 5 \
        | grep -q '"timed_out":false'; then ok=1; break; fi
    sleep 0.5
  done
  for ((i = 0; i < NODES; i++)); do copy_pid "$i"; done
  if (( ok == 0 )); then
    for ((i = 0; i < NODES; i++)); do
      tail -20 "$RUN_DIR/node-$i/logs/retrieval-local-$PORT.log" 2>/dev/null >&2 || true
    done
    ONLY_NODE=""; do_stop
    die "no healthy cluster within ${START_TIMEOUT}s"
  fi
  t1="$(date +%s.%N)"
  log "OpenSearch $VERSION ($NODES node(s), java $(java_major "$1")) healthy in $(awk "BEGIN{printf \"%.1f\", $t1-$START_T0}")s"
  print_running
}

copy_pid() {  # the JVM writes its pid file without a newline; keep ours line-terminated
  local src="$RUN_DIR/node-$1/opensearch.pid"
  if [[ -s "$src" ]]; then printf '%s\n' "$(tr -dc 0-9 <"$src")" >"$RUN_DIR/node-$1.pid"; fi
}

do_start() {
  if [[ -n "$ONLY_NODE" ]]; then start_single; return; fi
  local running=0 i
  for ((i = 0; i < NODES; i++)); do [[ -n "$(node_pid "$i")" ]] && running=$((running + 1)); done
  # Without --nodes, a cluster already set up on this port keeps its node count.
  if [[ -z "$NODES_GIVEN" && -f "$RUN_DIR/nodes" ]]; then NODES="$(cat "$RUN_DIR/nodes")"; fi
  for ((i = 0, running = 0; i < NODES; i++)); do [[ -n "$(node_pid "$i")" ]] && running=$((running + 1)); done
  if (( running == NODES )) && health "$PORT" >/dev/null; then
    log "already running"; print_running; return
  fi
  if [[ -f "$RUN_DIR/nodes" && "$(cat "$RUN_DIR/nodes")" != "$NODES" ]]; then
    log "running with $(cat "$RUN_DIR/nodes") node(s), $NODES asked: restarting"; do_stop
  elif (( running > 0 )); then  # some node was stopped (failover test): bring it back
    for ((i = 0; i < NODES; i++)); do
      if [[ -z "$(node_pid "$i")" ]]; then ONLY_NODE="$i"; start_single; fi
    done
    return 0
  fi
  local home java prefix data_root
  home="$(do_fetch)"
  java="$(pick_java)"
  prefix="$(run_as_prefix)"
  home="$(runtime_home "$prefix")"
  mkdir -p "$RUN_DIR"; chmod 755 "$STATE_BASE" "$STATE_BASE/run" "$RUN_DIR" 2>/dev/null || true
  if [[ -n "$DATA_DIR" ]]; then
    data_root="$(mkdir -p "$DATA_DIR" && cd "$DATA_DIR" && pwd)"; rm -f "$RUN_DIR/tempdata"
  else
    data_root="$(mktemp -d /tmp/opensearch-data-$PORT.XXXXXX)"; echo "$data_root" >"$RUN_DIR/tempdata"
  fi
  [[ -n "$prefix" ]] && chmod 755 "$data_root"
  echo "$NODES" >"$RUN_DIR/nodes"
  echo "$data_root" >"$RUN_DIR/dataroot"
  for ((i = 0; i < NODES; i++)); do
    start_node "$i" "$home" "$java" "$prefix" "$data_root"
  done
  wait_healthy "$java"
}

# ---------------------------------------------------------------------------------- stop
stray_pids() {  # index -> pids of JVMs running node I's config of this port, pid file or not
  pgrep -f -- "-Dopensearch.path.conf=$RUN_DIR/node-$1/config( |\$)" 2>/dev/null || true
}

kill_strays() {  # index -- a node whose pid file was lost (its starter was killed) still holds ports
  local p n
  for p in $(stray_pids "$1"); do
    log "node-$1: stopping a stray JVM of ours (pid $p, no pid file)"
    kill -CONT "$p" 2>/dev/null || true; kill -TERM "$p" 2>/dev/null || true
    for ((n = 0; n < 40; n++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$p" 2>/dev/null || true
  done
}

stop_one() {  # index
  local p i="$1" n
  p="$(node_pid "$i")"
  if [[ -n "$p" ]]; then
    kill -CONT "$p" 2>/dev/null || true  # a SIGSTOPped node cannot handle SIGTERM
    kill -TERM "$p" 2>/dev/null || true
    for ((n = 0; n < 60; n++)); do kill -0 "$p" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$p" 2>/dev/null; then log "node-$i ($p) ignored SIGTERM; killing"; kill -KILL "$p" || true; fi
    log "stopped node-$i (pid $p)"
  fi
  kill_strays "$i"
  rm -f "$RUN_DIR/node-$i.pid" "$RUN_DIR/node-$i/opensearch.pid"
}

do_stop() {
  [[ -d "$RUN_DIR" ]] || { log "not running (port $PORT)"; return 0; }
  if [[ -n "$ONLY_NODE" ]]; then stop_one "$ONLY_NODE"; return 0; fi
  local i n=2
  for ((i = n - 1; i >= 0; i--)); do stop_one "$i"; done
  if [[ -f "$RUN_DIR/tempdata" ]]; then
    local d; d="$(cat "$RUN_DIR/tempdata")"
    [[ "$d" == /tmp/opensearch-data-* ]] && rm -rf "$d"
    rm -f "$RUN_DIR/tempdata"
  fi
  rm -f "$RUN_DIR/nodes" "$RUN_DIR/dataroot"
}

do_status() {
  local i p any=0
  for ((i = 0; i < 2; i++)); do
    p="$(node_pid "$i")"
    [[ -n "$p" ]] && { echo "node-$i: running (pid $p, http port $((PORT + i)))"; any=1; }
  done
  if (( any == 0 )); then echo "not running (port $PORT)"; return 3; fi
  health "$PORT" || echo "(health unavailable)"
  echo
}

case "$CMD" in
  fetch) do_fetch ;;
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  url) echo "$URL" ;;
  *) usage; exit 2 ;;
esac
