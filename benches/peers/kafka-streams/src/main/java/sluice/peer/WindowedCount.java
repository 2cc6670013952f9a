package sluice.peer;

import java.time.Duration;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.common.utils.Bytes;
import org.apache.kafka.streams.KeyValue;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.Topology;
import org.apache.kafka.streams.kstream.Consumed;
import org.apache.kafka.streams.kstream.Grouped;
import org.apache.kafka.streams.kstream.Materialized;
import org.apache.kafka.streams.kstream.Produced;
import org.apache.kafka.streams.kstream.TimeWindows;
import org.apache.kafka.streams.state.WindowStore;

/**
 * bench-engine's job: per-key counts in 1-minute tumbling windows (store {@code counts}),
 * written to the output as JSON whenever the record cache flushes (at every commit), as
 * Sluice's {@code windowed_count} example: key {@code {"key":K,"window":{"start":S,"end":E}}},
 * value the count. Input values are not decoded (Sluice's reads them as unit).
 */
public final class WindowedCount {
  private WindowedCount() {}

  /** The output key: Sluice's {@code Windowed<String>} as JSON. */
  public static final class WindowedKey {
    public String key;
    public Window window;

    public WindowedKey() {}

    WindowedKey(String key, long start, long end) {
      this.key = key;
      this.window = new Window();
      this.window.start = start;
      this.window.end = end;
    }
  }

  /** A window, {@code [start, end)} in ms. */
  public static final class Window {
    public long start;
    public long end;
  }

  public static Topology topology(String input, String output, Duration grace) {
    StreamsBuilder b = new StreamsBuilder();
    b.stream(input, Consumed.with(Serdes.String(), Serdes.ByteArray()))
        .groupByKey(Grouped.with(Serdes.String(), Serdes.ByteArray()))
        .windowedBy(TimeWindows.ofSizeAndGrace(Duration.ofMinutes(1), grace))
        .count(Materialized.<String, Long, WindowStore<Bytes, byte[]>>as("counts")
            .withKeySerde(Serdes.String())
            .withValueSerde(Serdes.Long()))
        .toStream()
        .map((wk, count) -> KeyValue.pair(
            new WindowedKey(wk.key(), wk.window().start(), wk.window().end()), count))
        .to(output, Produced.with(
            new JsonSerde<>(WindowedKey.class), new JsonSerde<>(Long.class)));
    return b.build();
  }
}
