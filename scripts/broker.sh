#!/usr/bin/env bash
# A local Apache Kafka broker: one KRaft node (combined broker and controller)
# on free loopback ports, with a freshly formatted log directory.
#
#   scripts/broker.sh start NAME [--tls]  formats and starts it; prints the
#                                         PLAINTEXT bootstrap (127.0.0.1:PORT)
#   scripts/broker.sh tls NAME            prints "SSL_BOOTSTRAP SASL_SSL_BOOTSTRAP
#                                         CA OTHER_CA USER PASSWORD" of a broker
#                                         started with --tls
#   scripts/broker.sh restart NAME        stops it and starts it again on the
#                                         same ports and log directory
#   scripts/broker.sh stop NAME           ends it by its pid (the log directory
#                                         is removed)
#
# With --tls the broker also listens with SSL (a CA and a certificate for
# 127.0.0.1 made here with openssl) and SASL_SSL (SCRAM-SHA-512, the user's
# credentials written at format time). OTHER_CA is a CA that signed nothing.
# Everything of a broker lives in .tools/run/NAME/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pom="$root/scripts/kafka/pom.xml"
version="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$pom")"
libs="$root/.tools/kafka-$version/libs"
cmd="${1:?usage: broker.sh start|tls|restart|stop NAME}"
name="${2:-broker}"
dir="$root/.tools/run/$name"
user="sluice"

die() { echo "broker: $*" >&2; exit 1; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# The JVM's options. The heap stays small: the tests' traffic is light, and
# the machine is shared with the build and the tests.
java_opts=(-Xms256m -Xmx1g -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true
  -Dlog4j2.configurationFile="$dir/log4j2.properties" -Dkafka.logs.dir="$dir" -cp "$libs/*")

kafka_java() {
  java "${java_opts[@]}" "$@"
}

# A CA, a server certificate for 127.0.0.1 signed by it, and a second CA.
certificates() {
  local t="$dir/tls"
  mkdir -p "$t"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=sluice test CA" \
    -keyout "$t/ca.key" -out "$t/ca.pem" >/dev/null 2>&1
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=some other CA" \
    -keyout "$t/other-ca.key" -out "$t/other-ca.pem" >/dev/null 2>&1
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$t/server.key" -out "$t/server.csr" >/dev/null 2>&1
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >"$t/san.ext"
  openssl x509 -req -in "$t/server.csr" -CA "$t/ca.pem" -CAkey "$t/ca.key" \
    -CAcreateserial -days 2 -extfile "$t/san.ext" -out "$t/server.pem" >/dev/null 2>&1
  # Kafka's PEM key store: the PKCS#8 key, then the certificate chain.
  cat "$t/server.key" "$t/server.pem" >"$t/keystore.pem"
  python3 -c 'import secrets; print(secrets.token_hex(16))' >"$t/password"
  chmod 600 "$t/password" "$t"/*.key
}

write_config() {
  local tls="$1" listeners advertised
  listeners="PLAINTEXT://127.0.0.1:$(cat "$dir/port"),CONTROLLER://127.0.0.1:$(cat "$dir/controller.port")"
  advertised="PLAINTEXT://127.0.0.1:$(cat "$dir/port")"
  if [ "$tls" = 1 ]; then
    listeners="$listeners,SSL://127.0.0.1:$(cat "$dir/ssl.port"),SASL_SSL://127.0.0.1:$(cat "$dir/sasl.port")"
    advertised="$advertised,SSL://127.0.0.1:$(cat "$dir/ssl.port"),SASL_SSL://127.0.0.1:$(cat "$dir/sasl.port")"
  fi
  cat >"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$(cat "$dir/controller.port")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listeners=$listeners
advertised.listeners=$advertised
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL
log.dirs=$dir/data
num.partitions=1
# A single node: every internal topic has one replica.
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# Test-friendly: a group's first rebalance does not wait for more members, and
# a transaction may last no longer than the engine's default timeout (60 s),
# so one a crashed producer left open is aborted within a minute.
group.initial.rebalance.delay.ms=0
transaction.max.timeout.ms=60000
# The consumer group protocol (KIP-848) takes its session timeout and heartbeat
# interval from the broker (defaults 45 s and 5 s): as short here as the
# classic protocol's session_timeout_ms in the tests' configs (6 s), so a
# killed instance's partitions move as soon under either protocol.
group.consumer.min.session.timeout.ms=2000
group.consumer.session.timeout.ms=6000
group.consumer.min.heartbeat.interval.ms=500
group.consumer.heartbeat.interval.ms=1000
EOF
  if [ "$tls" = 1 ]; then
    cat >>"$dir/server.properties" <<EOF
ssl.keystore.type=PEM
ssl.keystore.location=$dir/tls/keystore.pem
ssl.client.auth=none
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
EOF
  fi
  cat >"$dir/log4j2.properties" <<EOF
appender.file.type=File
appender.file.name=file
appender.file.fileName=$dir/server.log
appender.file.layout.type=PatternLayout
appender.file.layout.pattern=[%d] %p %m (%c)%n
rootLogger.level=${KAFKA_LOG_LEVEL:-WARN}
rootLogger.appenderRef.file.ref=file
EOF
}

# Waits until the broker answers a Metadata request (v4) naming one broker.
wait_ready() {
  python3 - "$(cat "$dir/port")" "$(cat "$dir/pid")" <<'EOF'
import os, socket, struct, sys, time
port, pid = int(sys.argv[1]), int(sys.argv[2])
client = b"sluice-broker-script"
# Request header v1 (api key 3 = Metadata, version 4, correlation id, client id)
# and body: all topics (null array), no auto-creation.
body = struct.pack(">hhih", 3, 4, 1, len(client)) + client + struct.pack(">ib", -1, 0)
deadline = time.time() + 120
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(2)
    try:
        with socket.create_connection(("127.0.0.1", port), 1) as s:
            s.settimeout(5)
            s.sendall(struct.pack(">i", len(body)) + body)
            size = struct.unpack(">i", s.recv(4, socket.MSG_WAITALL))[0]
            resp = s.recv(size, socket.MSG_WAITALL)
            # correlation id, throttle time, then the brokers array's length.
            if struct.unpack(">i", resp[8:12])[0] >= 1:
                sys.exit(0)
    except (OSError, struct.error):
        pass
    time.sleep(0.2)
sys.exit(1)
EOF
}

launch() {
  # exec: the pid recorded is the broker's own (a kill reaches the JVM).
  (exec java "${java_opts[@]}" kafka.Kafka "$dir/server.properties") >>"$dir/stdout.log" 2>&1 &
  echo $! >"$dir/pid"
  if ! wait_ready; then
    tail -n 50 "$dir/server.log" "$dir/stdout.log" >&2 2>/dev/null || true
    stop
    die "Apache Kafka $version did not start (logs in $dir)"
  fi
}

stop() {
  [ -f "$dir/pid" ] || return 0
  local pid
  pid="$(cat "$dir/pid")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$dir/pid"
}

case "$cmd" in
  start)
    tls=0
    [ "${3:-}" = "--tls" ] && tls=1
    [ -f "$libs/kafka_2.13-$version.jar" ] || die "Apache Kafka $version not installed; run scripts/setup.sh"
    command -v java >/dev/null || die "java not found; run scripts/setup.sh"
    stop
    rm -rf "$dir" && mkdir -p "$dir"
    free_port >"$dir/port"
    free_port >"$dir/controller.port"
    scram=()
    if [ "$tls" = 1 ]; then
      command -v openssl >/dev/null || die "openssl not found; run scripts/setup.sh"
      free_port >"$dir/ssl.port"
      free_port >"$dir/sasl.port"
      certificates || die "cannot make test certificates"
      scram=(--add-scram "SCRAM-SHA-512=[name=$user,password=$(cat "$dir/tls/password")]")
    fi
    write_config "$tls"
    kafka_java kafka.tools.StorageTool format --standalone \
      --config "$dir/server.properties" \
      --cluster-id "$(kafka_java kafka.tools.StorageTool random-uuid)" \
      "${scram[@]}" >"$dir/format.log" 2>&1 \
      || { cat "$dir/format.log" >&2; die "kafka-storage format failed"; }
    launch
    echo "127.0.0.1:$(cat "$dir/port")"
    ;;
  tls)
    [ -f "$dir/tls/ca.pem" ] || die "broker $name was not started with --tls"
    echo "127.0.0.1:$(cat "$dir/ssl.port") 127.0.0.1:$(cat "$dir/sasl.port")" \
      "$dir/tls/ca.pem $dir/tls/other-ca.pem $user $(cat "$dir/tls/password")"
    ;;
  restart)
    [ -f "$dir/server.properties" ] || die "no broker $name to restart"
    stop
    launch
    echo "127.0.0.1:$(cat "$dir/port")"
    ;;
  stop)
    stop
    rm -rf "$dir"
    ;;
  *) echo "usage: broker.sh start|tls|restart|stop NAME" >&2; exit 2 ;;
esac
