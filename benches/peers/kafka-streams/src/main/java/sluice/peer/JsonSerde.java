package sluice.peer;

import com.fasterxml.jackson.databind.DeserializationFeature;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.ObjectReader;
import com.fasterxml.jackson.databind.ObjectWriter;
import java.io.IOException;
import java.util.Map;
import org.apache.kafka.common.errors.SerializationException;
import org.apache.kafka.common.serialization.Deserializer;
import org.apache.kafka.common.serialization.Serde;
import org.apache.kafka.common.serialization.Serializer;

/**
 * A Jackson serde of one type: the jobs' input, state and output values as JSON
 * (unknown fields ignored, as Sluice's serde decoding does).
 */
public final class JsonSerde<T> implements Serde<T>, Serializer<T>, Deserializer<T> {
  private static final ObjectMapper MAPPER =
      new ObjectMapper().disable(DeserializationFeature.FAIL_ON_UNKNOWN_PROPERTIES);

  private final ObjectReader reader;
  private final ObjectWriter writer;

  public JsonSerde(Class<T> type) {
    this.reader = MAPPER.readerFor(type);
    this.writer = MAPPER.writerFor(type);
  }

  @Override
  public byte[] serialize(String topic, T value) {
    if (value == null) {
      return null;
    }
    try {
      return writer.writeValueAsBytes(value);
    } catch (IOException e) {
      throw new SerializationException("JSON encoding", e);
    }
  }

  @Override
  public T deserialize(String topic, byte[] data) {
    if (data == null) {
      return null;
    }
    try {
      return reader.readValue(data);
    } catch (IOException e) {
      throw new SerializationException("JSON decoding", e);
    }
  }

  @Override
  public void configure(Map<String, ?> configs, boolean isKey) {}

  @Override
  public void close() {}

  @Override
  public Serializer<T> serializer() {
    return this;
  }

  @Override
  public Deserializer<T> deserializer() {
    return this;
  }
}
