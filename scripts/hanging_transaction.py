"""Does the broker leave a transaction open after a SIGKILL during commits?

Starts a broker of its own (scripts/broker.sh), runs three librdkafka
transactional producers committing 40-record transactions (with consumer
offsets, as Sluice's tasks do, unless --no-offsets) in a loop, SIGKILLs and
restarts the broker CYCLES times, then stops the producers and waits past
their 10 s transaction timeout. Every partition's last stable offset must
then equal its end; if one stays below, a transaction was left open for good
(a hanging transaction): the broker is left running for inspection with
kafka-transactions.sh, and the exit status is 1. Run by
scripts/hanging-transaction.sh. No Sluice code is involved.
"""

import argparse
import os
import random
import subprocess
import sys
import threading
import time

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BROKER = os.path.join(ROOT, "scripts", "broker.sh")
TOPIC, PARTITIONS, TIMEOUT_MS = "hang-t", 4, 10_000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cycles", type=int, nargs="?", default=40)
    ap.add_argument("--no-offsets", action="store_true")
    args = ap.parse_args()
    name = f"hang-{os.getpid()}"
    boot = subprocess.check_output([BROKER, "start", name]).decode().strip()
    pid_file = os.path.join(ROOT, ".tools", "run", name, "pid")
    print(f"broker {name} at {boot}", flush=True)
    admin = AdminClient({"bootstrap.servers": boot})
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])[TOPIC].result()
    stop = threading.Event()
    counts = {"committed": 0, "failed": 0}

    def produce(tid: str) -> None:
        while not stop.is_set():
            try:
                p = Producer({"bootstrap.servers": boot, "transactional.id": tid,
                              "transaction.timeout.ms": TIMEOUT_MS, "linger.ms": 5})
                p.init_transactions(30)
                group = Consumer({"bootstrap.servers": boot, "group.id": f"g-{tid}"})
                n = 0
                while not stop.is_set():
                    p.begin_transaction()
                    for i in range(40):
                        p.produce(TOPIC, b"v" * 100, key=str(i).encode(), partition=i % PARTITIONS)
                    n += 1
                    if not args.no_offsets:
                        offsets = [TopicPartition(TOPIC, q, n) for q in range(PARTITIONS)]
                        p.send_offsets_to_transaction(offsets, group.consumer_group_metadata(), 30)
                    p.commit_transaction(30)
                    counts["committed"] += 1
            except Exception:  # the broker went away: start over with a new producer
                counts["failed"] += 1
                time.sleep(0.2)

    threads = [threading.Thread(target=produce, args=(f"tx-{k}",), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    for cycle in range(args.cycles):
        time.sleep(random.uniform(1.0, 3.0))
        with open(pid_file) as f:
            subprocess.run(["kill", "-KILL", f.read().strip()], check=True)
        time.sleep(random.uniform(0.5, 3.0))
        subprocess.check_output([BROKER, "restart", name])
        print(f"cycle {cycle}: restarted; transactions {counts}", flush=True)
    stop.set()
    for t in threads:
        t.join(60)

    def ends(isolation: str) -> list:
        c = Consumer({"bootstrap.servers": boot, "group.id": "check", "isolation.level": isolation})
        try:
            return [c.get_watermark_offsets(TopicPartition(TOPIC, p), timeout=20)[1]
                    for p in range(PARTITIONS)]
        finally:
            c.close()

    time.sleep(25)  # past the transaction timeout and the coordinator's 10 s sweep
    for _ in range(6):
        stable, end = ends("read_committed"), ends("read_uncommitted")
        print(f"last stable offsets {stable}, ends {end}", flush=True)
        if stable == end:
            subprocess.run([BROKER, "stop", name], check=True)
            print("no transaction left open")
            return 0
        time.sleep(20)
    print(f"a transaction was left open; broker {name} at {boot} kept running "
          f"(kafka-transactions.sh find-hanging --broker-id 1 --max-transaction-timeout 1; "
          f"scripts/broker.sh stop {name})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
