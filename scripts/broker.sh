#!/usr/bin/env bash
# Starts or stops a fresh local tansu broker on a free loopback port.
#   scripts/broker.sh start NAME   -> prints the bootstrap address (127.0.0.1:PORT)
#   scripts/broker.sh stop NAME
# State lives in .tools/run/NAME.{pid,port,log}; memory storage, so every start is empty.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
run="$root/.tools/run"
bin="$root/.tools/bin/tansu"
cmd="${1:?usage: broker.sh start|stop NAME}"
name="${2:-broker}"
mkdir -p "$run"

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

case "$cmd" in
  start)
    [ -x "$bin" ] || { echo "broker: tansu not installed; run scripts/setup.sh" >&2; exit 1; }
    "$0" stop "$name" >/dev/null 2>&1 || true
    port="$(free_port)"
    RUST_LOG="${TANSU_LOG:-warn}" nohup "$bin" broker \
      --listener-url "tcp://127.0.0.1:$port" \
      --advertised-listener-url "tcp://127.0.0.1:$port" \
      --storage-engine "memory://tansu/" \
      >"$run/$name.log" 2>&1 &
    echo $! >"$run/$name.pid"
    echo "$port" >"$run/$name.port"
    for _ in $(seq 1 100); do
      if python3 -c "import socket,sys; socket.create_connection(('127.0.0.1',$port),0.2)" 2>/dev/null; then
        echo "127.0.0.1:$port"; exit 0
      fi
      kill -0 "$(cat "$run/$name.pid")" 2>/dev/null || break
      sleep 0.1
    done
    echo "broker: tansu did not start; log follows" >&2
    cat "$run/$name.log" >&2
    exit 1
    ;;
  stop)
    if [ -f "$run/$name.pid" ]; then
      pid="$(cat "$run/$name.pid")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$run/$name.pid" "$run/$name.port"
    fi
    ;;
  *) echo "usage: broker.sh start|stop NAME" >&2; exit 2 ;;
esac
