package sluice.peer;

import com.fasterxml.jackson.databind.JsonNode;
import java.time.Duration;
import java.time.Instant;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.common.utils.Bytes;
import org.apache.kafka.streams.KeyValue;
import org.apache.kafka.streams.StreamsBuilder;
import org.apache.kafka.streams.Topology;
import org.apache.kafka.streams.kstream.Consumed;
import org.apache.kafka.streams.kstream.Grouped;
import org.apache.kafka.streams.kstream.KGroupedStream;
import org.apache.kafka.streams.kstream.Materialized;
import org.apache.kafka.streams.kstream.Produced;
import org.apache.kafka.streams.kstream.TimeWindows;
import org.apache.kafka.streams.processor.TimestampExtractor;
import org.apache.kafka.streams.state.WindowStore;

/**
 * bench-usage's job: Sluice's {@code account} operator with its default windows. Each
 * successful task result (keyed by tenant) adds one request, its input, output and cached
 * tokens and its cost (micro-dollars), in total and for its model, to the tenant's tumbling
 * window of each size (1 minute, 1 hour, 1 day, 30 days), by its {@code completedAt}; each
 * size is a windowed aggregation with its own RocksDB window store, kept as long as Sluice
 * keeps it (late results are accepted while it is kept). Every window update goes to the
 * usage topic, keyed by tenant, as the same JSON record Sluice writes, whenever the record
 * cache flushes (at every commit).
 */
public final class TenantAccounting {
  private TenantAccounting() {}

  /** A window size, and how long its windows are kept after they start. */
  record WindowSpec(String name, Duration size, Duration retention) {}

  /** Sluice's {@code default_windows()}. */
  static final List<WindowSpec> WINDOWS = List.of(
      new WindowSpec("1m", Duration.ofMinutes(1), Duration.ofHours(2)),
      new WindowSpec("1h", Duration.ofHours(1), Duration.ofDays(2)),
      new WindowSpec("1d", Duration.ofDays(1), Duration.ofDays(35)),
      new WindowSpec("30d", Duration.ofDays(30), Duration.ofDays(90)));

  /** A task result, as on {@code ai.results.completed} (every field decoded, as Sluice does). */
  public static final class TaskResult {
    public String taskId;
    public String taskType;
    public String tenantId;
    public boolean success;
    public String completedAt;
    public long processingMs;
    public String model;
    public Route route;
    public long inputTokens;
    public long outputTokens;
    public long cachedTokens;
    public long costMicros;
    public int attempts;
    public String batchId;
    public JsonNode output;
    public String errorCode;
    public String errorMessage;
    public Map<String, String> metadata;
  }

  /** The routing decision recorded in a result. */
  public static final class Route {
    public String tier;
    public String reason;
  }

  /** Requests, tokens and cost: a window's totals or one model's share. */
  public static final class ModelUsage {
    public long requests;
    public long inputTokens;
    public long outputTokens;
    public long cachedTokens;
    public long costMicros;

    void add(TaskResult r) {
      requests += 1;
      inputTokens += r.inputTokens;
      outputTokens += r.outputTokens;
      cachedTokens += r.cachedTokens;
      costMicros += r.costMicros;
    }
  }

  /** A tenant's window in its store: totals and the per-model breakdown. */
  public static final class TenantUsage {
    public ModelUsage total = new ModelUsage();
    public TreeMap<String, ModelUsage> byModel = new TreeMap<>();

    TenantUsage add(TaskResult r) {
      total.add(r);
      byModel.computeIfAbsent(r.model, m -> new ModelUsage()).add(r);
      return this;
    }
  }

  /** A usage update on the usage topic: Sluice's {@code UsageRecord} JSON. */
  public static final class UsageRecord {
    public String tenantId;
    public String window;
    public long windowStart;
    public long windowEnd;
    public long requests;
    public long inputTokens;
    public long outputTokens;
    public long cachedTokens;
    public long costMicros;
    public TreeMap<String, ModelUsage> byModel;

    public UsageRecord() {}

    UsageRecord(String tenant, WindowSpec w, long start, long end, TenantUsage u) {
      tenantId = tenant;
      window = w.name();
      windowStart = start;
      windowEnd = end;
      requests = u.total.requests;
      inputTokens = u.total.inputTokens;
      outputTokens = u.total.outputTokens;
      cachedTokens = u.total.cachedTokens;
      costMicros = u.total.costMicros;
      byModel = u.byModel;
    }
  }

  /** A result's time is its {@code completedAt} (RFC 3339, or epoch ms), as Sluice's. */
  public static final class CompletedAt implements TimestampExtractor {
    @Override
    public long extract(ConsumerRecord<Object, Object> record, long partitionTime) {
      String at = ((TaskResult) record.value()).completedAt;
      if (!at.isEmpty() && at.chars().allMatch(Character::isDigit)) {
        return Long.parseLong(at);
      }
      return Instant.parse(at).toEpochMilli();
    }
  }

  public static Topology topology(String input, String usageTopic) {
    StreamsBuilder b = new StreamsBuilder();
    JsonSerde<TaskResult> results = new JsonSerde<>(TaskResult.class);
    JsonSerde<TenantUsage> usage = new JsonSerde<>(TenantUsage.class);
    Produced<String, UsageRecord> produced =
        Produced.with(Serdes.String(), new JsonSerde<>(UsageRecord.class));
    // Results are keyed by tenant: grouped as they come, no repartition.
    KGroupedStream<String, TaskResult> byTenant = b
        .stream(input, Consumed.with(Serdes.String(), results)
            .withTimestampExtractor(new CompletedAt()))
        .filter((tenant, r) -> r.success)
        .groupByKey(Grouped.with(Serdes.String(), results));
    for (WindowSpec w : WINDOWS) {
      Duration kept = w.retention().compareTo(w.size()) > 0 ? w.retention() : w.size();
      byTenant
          .windowedBy(TimeWindows.ofSizeAndGrace(w.size(), kept.minus(w.size())))
          .aggregate(
              TenantUsage::new,
              (tenant, r, u) -> u.add(r),
              Materialized.<String, TenantUsage, WindowStore<Bytes, byte[]>>as("usage-" + w.name())
                  .withKeySerde(Serdes.String())
                  .withValueSerde(usage)
                  .withRetention(kept))
          .toStream()
          .map((wk, u) -> KeyValue.pair(wk.key(), new UsageRecord(
              wk.key(), w, wk.window().start(), wk.window().end(), u)))
          .to(usageTopic, produced);
    }
    return b.build();
  }
}
