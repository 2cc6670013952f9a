package sluice.peer;

import java.io.IOException;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.Topology;
import org.apache.kafka.streams.errors.StreamsUncaughtExceptionHandler.StreamThreadExceptionResponse;

/**
 * Runs one of the benchmark jobs on Kafka Streams until its standard input closes, then
 * closes it cleanly.
 *
 * <pre>
 * KafkaStreamsPeer count|usage --bootstrap HOST:PORT --app-id ID --input TOPIC
 *     --output TOPIC --state-dir DIR --threads N [--grace-ms MS] [--cache-bytes N]
 * </pre>
 *
 * <p>Exactly-once (v2), a 100 ms commit interval, the default record cache (10 MB unless
 * {@code --cache-bytes} says otherwise), RocksDB stores.
 * Prints {@code FIRST_IN <epoch ms>} when the first input records are polled, {@code
 * RUNNING <epoch ms>} when the client is running, {@code CLOSED ok} after a clean close; exits
 * with 1 if the client fails.
 */
public final class KafkaStreamsPeer {
  private KafkaStreamsPeer() {}

  public static void main(String[] argv) throws Exception {
    // slf4j-simple (before any logger exists): warnings and errors, but not
    // the advice about global-state exception handling (there is no global
    // state) or about a state directory under /tmp (it is a fresh one).
    logLevel("org.slf4j.simpleLogger.defaultLogLevel", "warn");
    logLevel("org.slf4j.simpleLogger.log.org.apache.kafka.streams.StreamsConfig", "error");
    logLevel("org.slf4j.simpleLogger.log.org.apache.kafka.streams.processor.internals.StateDirectory",
        "error");
    if (argv.length < 1) {
      usage();
    }
    String job = argv[0];
    Map<String, String> args = new HashMap<>();
    for (int i = 1; i + 1 < argv.length; i += 2) {
      if (!argv[i].startsWith("--")) {
        usage();
      }
      args.put(argv[i].substring(2), argv[i + 1]);
    }
    Topology topology = switch (job) {
      case "count" -> WindowedCount.topology(
          need(args, "input"), need(args, "output"),
          Duration.ofMillis(Long.parseLong(args.getOrDefault("grace-ms", "0"))));
      case "usage" -> TenantAccounting.topology(need(args, "input"), need(args, "output"));
      default -> {
        usage();
        yield null;
      }
    };

    Properties p = new Properties();
    p.put(StreamsConfig.APPLICATION_ID_CONFIG, need(args, "app-id"));
    p.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, need(args, "bootstrap"));
    p.put(StreamsConfig.STATE_DIR_CONFIG, need(args, "state-dir"));
    p.put(StreamsConfig.NUM_STREAM_THREADS_CONFIG, Integer.parseInt(need(args, "threads")));
    p.put(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.EXACTLY_ONCE_V2);
    p.put(StreamsConfig.COMMIT_INTERVAL_MS_CONFIG, 100);
    if (args.containsKey("cache-bytes")) {
      p.put(StreamsConfig.STATESTORE_CACHE_MAX_BYTES_CONFIG, Long.parseLong(args.get("cache-bytes")));
    }
    p.put(StreamsConfig.mainConsumerPrefix(ConsumerConfig.INTERCEPTOR_CLASSES_CONFIG),
        FirstRecordInterceptor.class.getName());

    KafkaStreams streams = new KafkaStreams(topology, p);
    CountDownLatch done = new CountDownLatch(1);
    boolean[] failed = {false};
    streams.setUncaughtExceptionHandler(e -> {
      System.err.println("kafka-streams peer: stream thread failed: " + e);
      e.printStackTrace();
      return StreamThreadExceptionResponse.SHUTDOWN_CLIENT;
    });
    streams.setStateListener((now, before) -> {
      if (now == KafkaStreams.State.RUNNING) {
        System.out.println("RUNNING " + System.currentTimeMillis());
        System.out.flush();
      }
      if (now == KafkaStreams.State.ERROR) {
        failed[0] = true;
        done.countDown();
      }
    });
    Thread stdin = new Thread(() -> {
      try {
        while (System.in.read() >= 0) {
          // The end of input is the signal to stop.
        }
      } catch (IOException e) {
        // The same.
      }
      done.countDown();
    }, "stdin");
    stdin.setDaemon(true);
    stdin.start();

    streams.start();
    done.await();
    boolean clean = streams.close(Duration.ofSeconds(60));
    if (failed[0] || !clean) {
      System.err.println("kafka-streams peer: " + (failed[0] ? "failed" : "did not close in time"));
      System.exit(1);
    }
    System.out.println("CLOSED ok");
    System.out.flush();
    System.exit(0);
  }

  private static void logLevel(String property, String level) {
    if (System.getProperty(property) == null) {
      System.setProperty(property, level);
    }
  }

  private static String need(Map<String, String> args, String name) {
    String v = args.get(name);
    if (v == null) {
      System.err.println("kafka-streams peer: --" + name + " missing");
      usage();
    }
    return v;
  }

  private static void usage() {
    System.err.println("usage: KafkaStreamsPeer count|usage --bootstrap B --app-id ID"
        + " --input T --output T --state-dir DIR --threads N [--grace-ms MS] [--cache-bytes N]");
    System.exit(2);
  }
}
