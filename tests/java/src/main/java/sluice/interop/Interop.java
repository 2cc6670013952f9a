package sluice.interop;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.SerializationFeature;
import com.fasterxml.jackson.databind.node.ObjectNode;
import com.fasterxml.jackson.datatype.jsr310.JavaTimeModule;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * What a Java service does around Sluice, with the Java clients' defaults.
 *
 * <pre>
 * produce BOOTSTRAP TOPIC TASKS TENANTS   publishes classify tasks keyed by tenant
 *                                         (default partitioner: murmur2); prints one
 *                                         JSON line per task: taskId, tenantId, partition
 * consume BOOTSTRAP GROUP TASKS SECONDS TOPIC...
 *                                         reads results read_committed until TASKS distinct
 *                                         task ids (then 3 s more) or SECONDS pass; prints
 *                                         one JSON line per record read
 * </pre>
 */
public final class Interop {
  /** The seeds' task envelope, as a Spring service declares it. */
  public record Task(
      String taskId,
      String taskType,
      String tenantId,
      String requesterId,
      String priority,
      Instant submittedAt,
      int attemptNumber,
      Map<String, Object> payload,
      Map<String, String> metadata) {}

  public static void main(String[] args) throws Exception {
    switch (args.length > 0 ? args[0] : "") {
      case "produce" -> produce(args[1], args[2], Integer.parseInt(args[3]), Integer.parseInt(args[4]));
      case "consume" -> consume(args[1], args[2], Integer.parseInt(args[3]), Integer.parseInt(args[4]),
          List.of(args).subList(5, args.length));
      default -> {
        System.err.println("usage: Interop produce|consume ...");
        System.exit(2);
      }
    }
  }

  static void produce(String bootstrap, String topic, int tasks, int tenants) throws Exception {
    // Spring Boot's ObjectMapper: Instant as an ISO-8601 string.
    ObjectMapper iso = new ObjectMapper().registerModule(new JavaTimeModule())
        .disable(SerializationFeature.WRITE_DATES_AS_TIMESTAMPS);
    // Jackson with timestamps on and nanoseconds off: Instant as epoch milliseconds.
    ObjectMapper millis = new ObjectMapper().registerModule(new JavaTimeModule())
        .enable(SerializationFeature.WRITE_DATES_AS_TIMESTAMPS)
        .disable(SerializationFeature.WRITE_DATE_TIMESTAMPS_AS_NANOSECONDS);
    ObjectMapper out = new ObjectMapper();
    Properties p = new Properties();
    p.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
    p.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
    p.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, StringSerializer.class.getName());
    p.put(ProducerConfig.ACKS_CONFIG, "all");
    try (KafkaProducer<String, String> producer = new KafkaProducer<>(p)) {
      List<String> lines = new ArrayList<>();
      for (int i = 0; i < tasks; i++) {
        String tenant = "tenant-" + (i % tenants);
        String id = "java-" + i + "-" + Long.toHexString(System.nanoTime());
        Task t = new Task(id, "classify", tenant, "billing-service", "normal", Instant.now(), 1,
            Map.of("content", "Invoice " + i + " for " + tenant + ": quarterly hosting charges.",
                "labels", List.of("news", "sports", "tech")),
            Map.of("correlationId", "corr-" + id));
        String value = (i % 2 == 0 ? iso : millis).writeValueAsString(t);
        // Key = tenant, partition left to the default partitioner.
        RecordMetadata m = producer.send(new ProducerRecord<>(topic, tenant, value)).get();
        ObjectNode line = out.createObjectNode();
        line.put("taskId", id).put("tenantId", tenant).put("partition", m.partition())
            .put("submittedAt", out.readTree(value).get("submittedAt").toString());
        lines.add(out.writeValueAsString(line));
      }
      lines.forEach(System.out::println);
    }
  }

  static void consume(String bootstrap, String group, int tasks, int seconds, List<String> topics) throws Exception {
    ObjectMapper json = new ObjectMapper();
    Properties p = new Properties();
    p.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
    p.put(ConsumerConfig.GROUP_ID_CONFIG, group);
    p.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
    p.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
    p.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());
    p.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class.getName());
    long deadline = System.currentTimeMillis() + seconds * 1000L;
    long until = Long.MAX_VALUE;
    Set<String> ids = new HashSet<>();
    try (KafkaConsumer<String, String> consumer = new KafkaConsumer<>(p)) {
      consumer.subscribe(topics);
      while (System.currentTimeMillis() < Math.min(deadline, until)) {
        for (ConsumerRecord<String, String> r : consumer.poll(Duration.ofMillis(200))) {
          ObjectNode line = json.createObjectNode();
          line.put("topic", r.topic()).put("partition", r.partition()).put("offset", r.offset())
              .put("key", r.key());
          JsonNode value = json.readTree(r.value());
          line.set("value", value);
          System.out.println(json.writeValueAsString(line));
          ids.add(r.key());
        }
        if (ids.size() >= tasks && until == Long.MAX_VALUE) {
          // A little longer, to read any second result of a task.
          until = System.currentTimeMillis() + 3000;
        }
      }
    }
  }
}
