#!/usr/bin/env bash
# Starts or stops a local broker reachable only over TLS: a fresh tansu broker
# on a loopback port, behind stunnel as a TLS-terminating proxy, the broker
# advertising the proxy's address (the broker's own TLS options do not work).
#   scripts/tls-broker.sh start NAME  -> prints "BOOTSTRAP CA_FILE OTHER_CA_FILE"
#                                        (OTHER_CA_FILE: a CA that did not sign it)
#   scripts/tls-broker.sh stop NAME
# Certificates and state live in .tools/run/NAME-tls/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
run="$root/.tools/run"
bin="$root/.tools/bin/tansu"
cmd="${1:?usage: tls-broker.sh start|stop NAME}"
name="${2:-tls}"
dir="$run/$name-tls"

die() { echo "tls-broker: $*" >&2; exit 1; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

wait_port() {
  for _ in $(seq 1 100); do
    python3 -c "import socket; socket.create_connection(('127.0.0.1',$1),0.2)" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

stop() {
  for what in stunnel broker; do
    if [ -f "$dir/$what.pid" ]; then
      pid="$(cat "$dir/$what.pid")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/$what.pid"
    fi
  done
}

# A CA and a server certificate for 127.0.0.1 signed by it, plus a second CA.
certificates() {
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=sluice test CA" \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" >/dev/null 2>&1
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=some other CA" \
    -keyout "$dir/other-ca.key" -out "$dir/other-ca.pem" >/dev/null 2>&1
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$dir/server.key" -out "$dir/server.csr" >/dev/null 2>&1
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >"$dir/san.ext"
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -CAcreateserial -days 2 -extfile "$dir/san.ext" -out "$dir/server.pem" >/dev/null 2>&1
}

case "$cmd" in
  start)
    [ -x "$bin" ] || die "tansu not installed; run scripts/setup.sh"
    stunnel="$(command -v stunnel4 || command -v stunnel || true)"
    [ -n "$stunnel" ] || die "stunnel4 not installed; run scripts/setup.sh"
    command -v openssl >/dev/null || die "openssl not installed; run scripts/setup.sh"
    stop
    rm -rf "$dir" && mkdir -p "$dir"
    certificates || die "cannot make test certificates"
    plain="$(free_port)"
    tls="$(free_port)"
    RUST_LOG="${TANSU_LOG:-warn}" nohup "$bin" broker \
      --listener-url "tcp://127.0.0.1:$plain" \
      --advertised-listener-url "tcp://127.0.0.1:$tls" \
      --storage-engine "memory://tansu/" \
      >"$dir/broker.log" 2>&1 &
    echo $! >"$dir/broker.pid"
    cat >"$dir/stunnel.conf" <<EOF
foreground = yes
pid =
output = $dir/stunnel.log
[kafka]
accept = 127.0.0.1:$tls
connect = 127.0.0.1:$plain
cert = $dir/server.pem
key = $dir/server.key
EOF
    nohup "$stunnel" "$dir/stunnel.conf" >>"$dir/stunnel.log" 2>&1 &
    echo $! >"$dir/stunnel.pid"
    wait_port "$plain" || { cat "$dir/broker.log" >&2; stop; die "tansu did not start"; }
    wait_port "$tls" || { cat "$dir/stunnel.log" >&2; stop; die "stunnel did not start"; }
    echo "127.0.0.1:$tls $dir/ca.pem $dir/other-ca.pem"
    ;;
  stop) stop ;;
  *) echo "usage: tls-broker.sh start|stop NAME" >&2; exit 2 ;;
esac
