import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.stream.Collectors;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.TopicPartition;

/**
 * Reads a topic from the beginning to its end with a plain Java consumer and the deserializer a user configures
 * (Apicurio's AvroKafkaDeserializer here), printing each record as "REC partition offset key value", where key
 * and value are Avro's own JSON rendering of the decoded GenericRecord (or null).
 *
 * <p>Arguments: bootstrap servers, topic, then the deserializer's settings as key=value pairs.
 */
public final class AvroConsume {
    private AvroConsume() {}

    public static void main(String[] args) {
        Properties props = new Properties();
        props.put("bootstrap.servers", args[0]);
        props.put("isolation.level", "read_committed");
        props.put("enable.auto.commit", "false");
        for (int i = 2; i < args.length; i++) {
            String[] kv = args[i].split("=", 2);
            props.put(kv[0], kv[1]);
        }
        String topic = args[1];
        try (KafkaConsumer<Object, Object> consumer = new KafkaConsumer<>(props)) {
            List<TopicPartition> partitions = consumer.partitionsFor(topic).stream()
                    .map(p -> new TopicPartition(topic, p.partition()))
                    .collect(Collectors.toCollection(ArrayList::new));
            consumer.assign(partitions);
            consumer.seekToBeginning(partitions);
            Map<TopicPartition, Long> end = consumer.endOffsets(partitions);
            Set<TopicPartition> pending = partitions.stream()
                    .filter(tp -> end.get(tp) > 0)
                    .collect(Collectors.toSet());
            long records = 0;
            while (!pending.isEmpty()) {
                for (ConsumerRecord<Object, Object> r : consumer.poll(Duration.ofSeconds(1))) {
                    records++;
                    System.out.println("REC " + r.partition() + " " + r.offset() + " " + r.key() + "\t" + r.value());
                }
                // Transaction markers take offsets too: a partition is done when its position passes its end.
                pending.removeIf(tp -> consumer.position(tp) >= end.get(tp));
            }
            System.out.println("RECORDS " + records);
        }
    }
}
