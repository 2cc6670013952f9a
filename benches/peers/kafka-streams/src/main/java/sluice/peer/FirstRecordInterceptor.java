package sluice.peer;

import java.util.Map;
import java.util.concurrent.atomic.AtomicBoolean;
import org.apache.kafka.clients.consumer.ConsumerInterceptor;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.OffsetAndMetadata;
import org.apache.kafka.common.TopicPartition;

/**
 * On the main consumer of every stream thread: prints {@code FIRST_IN <epoch ms>} when the
 * first input records come back from a poll, once per process. It is where the benchmark's
 * clock starts, as Sluice's starts at its first record taken in.
 */
public final class FirstRecordInterceptor implements ConsumerInterceptor<Object, Object> {
  private static final AtomicBoolean SEEN = new AtomicBoolean();

  @Override
  public ConsumerRecords<Object, Object> onConsume(ConsumerRecords<Object, Object> records) {
    if (!records.isEmpty() && !SEEN.get() && SEEN.compareAndSet(false, true)) {
      long now = System.currentTimeMillis();
      System.out.println("FIRST_IN " + now);
      System.out.flush();
    }
    return records;
  }

  @Override
  public void onCommit(Map<TopicPartition, OffsetAndMetadata> offsets) {}

  @Override
  public void close() {}

  @Override
  public void configure(Map<String, ?> configs) {}
}
