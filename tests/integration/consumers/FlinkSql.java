import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Instant;
import java.time.LocalDateTime;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.ArrayList;
import java.util.Base64;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.apache.flink.table.api.EnvironmentSettings;
import org.apache.flink.table.api.TableEnvironment;
import org.apache.flink.types.Row;
import org.apache.flink.types.RowKind;
import org.apache.flink.util.CloseableIterator;

/**
 * Runs a Flink SQL script in a local mini-cluster, the way a user's job would, and prints what its last
 * statement (a bounded SELECT over a changelog table) materializes.
 *
 * <p>Statements are separated by a line holding only ";". The SELECT's changelog (+I, -U, +U, -D) is applied as
 * Flink's own semantics define it: a multiset where a retraction removes one equal row. A retraction of a row
 * that is not there is an error, because it means Flink saw a change whose "before" image differs from what it
 * holds. Output: one line "ROW <json array>" per row left, then "CHANGES <n>".
 */
public final class FlinkSql {
    private static final DateTimeFormatter MICROS = DateTimeFormatter.ofPattern("uuuu-MM-dd'T'HH:mm:ss.SSSSSS");
    private static final DateTimeFormatter UTC_MICROS = MICROS.withZone(ZoneOffset.UTC);

    private FlinkSql() {}

    public static void main(String[] args) throws Exception {
        List<String> statements = new ArrayList<>();
        for (String part : Files.readString(Path.of(args[0])).split("(?m)^;\\s*$")) {
            if (!part.isBlank()) {
                statements.add(part.strip());
            }
        }
        TableEnvironment env = TableEnvironment.create(EnvironmentSettings.inStreamingMode());
        env.getConfig().set("parallelism.default", "1");
        for (String statement : statements.subList(0, statements.size() - 1)) {
            env.executeSql(statement);
        }
        Map<String, Integer> rows = new HashMap<>();
        long changes = 0;
        try (CloseableIterator<Row> it = env.executeSql(statements.get(statements.size() - 1)).collect()) {
            while (it.hasNext()) {
                Row row = it.next();
                changes++;
                RowKind kind = row.getKind();
                String json = json(row);
                if (kind == RowKind.INSERT || kind == RowKind.UPDATE_AFTER) {
                    rows.merge(json, 1, Integer::sum);
                } else if (rows.merge(json, -1, Integer::sum) < 0) {
                    throw new IllegalStateException(kind + " of a row Flink does not hold: " + json);
                }
            }
        }
        for (Map.Entry<String, Integer> entry : rows.entrySet()) {
            for (int i = 0; i < entry.getValue(); i++) {
                System.out.println("ROW " + entry.getKey());
            }
        }
        System.out.println("CHANGES " + changes);
        System.exit(0); // the mini-cluster's threads would keep the JVM alive a while
    }

    private static String json(Row row) {
        StringBuilder out = new StringBuilder("[");
        for (int i = 0; i < row.getArity(); i++) {
            out.append(i == 0 ? "" : ",").append(value(row.getField(i)));
        }
        return out.append(']').toString();
    }

    private static String value(Object v) {
        if (v == null) {
            return "null";
        }
        if (v instanceof Boolean || v instanceof Integer || v instanceof Long || v instanceof Short) {
            return v.toString();
        }
        if (v instanceof LocalDateTime moment) {
            return quote(MICROS.format(moment)); // toString drops zero seconds and fractions
        }
        if (v instanceof Instant instant) {
            return quote(UTC_MICROS.format(instant) + "Z");
        }
        if (v instanceof byte[] bytes) {
            return quote(Base64.getEncoder().encodeToString(bytes));
        }
        return quote(v.toString()); // decimals, floats, dates and times as their exact Java text
    }

    private static String quote(String s) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') {
                out.append('\\').append(c);
            } else if (c < 0x20) {
                out.append(String.format("\\u%04x", (int) c));
            } else {
                out.append(c);
            }
        }
        return out.append('"').toString();
    }
}
