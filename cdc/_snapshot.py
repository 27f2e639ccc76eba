"""The initial snapshot: every row of the captured tables as ``op=r`` events, in chunks, resumable.

Rows are read with ``COPY (SELECT …) TO STDOUT (FORMAT binary)``: binary COPY carries each value in the
same send format pgoutput uses with ``binary 'true'``, so the stream's converters serve both paths. Tables are
read by several connections in parallel, a large table in several ranges at once, in one of two ways:

- **Block ranges** (the slot's exported snapshot, plain tables up to ``snapshot_scan_max_mb``, the C build):
  each range is one unordered COPY of a range of heap blocks (``ctid >= '(lo,0)' AND ctid < '(hi,0)'``, a TID
  range scan, PostgreSQL 14+; one range before), handed on in chunks of ``snapshot_chunk_rows`` rows or ~8 MB.
  It costs PostgreSQL what a plain sequential COPY does; the key order below costs it ~15 % more per row (an
  index scan), the largest single part of the box's CPU. Block positions mean nothing outside the snapshot
  they were read in, so a table interrupted while read this way starts again from its first row, in key
  order, with the fresh snapshot of the restart: the size limit bounds that redo. A table rewritten between
  the reads of its ranges (its file changes) is restarted the same way.
- **Key order** (larger tables, a restart, partitioned tables, no C build): ``COPY (SELECT … ORDER BY key
  LIMIT n)`` keyset chunks, the table split into key ranges where a sample of its keys says (the split only
  balances the work, each range reads all the keys between its bounds). It resumes after the last committed
  key with any snapshot.

The chunks are written to Kafka in transactions together with the snapshot's progress (per table and range:
the last key read, or that a block range is done), committed every ``snapshot_commit_interval_s``.

The hot loops are in C when the C build is there (cdc/_native.pyx): the COPY is read through libpq without
the GIL (CopyReader), a chunk is encoded in one call into one bytes object (TuplePlan.encode_copy_packed) and
produced in one call without the GIL (DirectProducer), so the reader thread and the main thread run at once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from cdc._catalog import TableInfo
from cdc._chunks import (
    Chunk,
    Keyset,
    LibpqCopies,
    RangeJob,
    ReadRange,
    block_cuts,
    copy_reader,
    open_copies,
    packed_keys,
    read_keyset,
    refuse_read,
    where_all,
)
from cdc._encoder import CopyRowRefused
from cdc._events import ColumnSpec, Position, TableCodec
from cdc._offsets import CaptureState, RangeProgress, SnapshotState, TableProgress
from cdc._published import filter_condition
from cdc._resnapshot import GapDeletes, Reconciler
from cdc.errors import TransientError

if TYPE_CHECKING:
    from cdc._attach import Attached, CaptureContext
    from cdc._batch import BatchWriter

log = logging.getLogger(__name__)


# A table is split into ranges of at least this many chunks: fewer would spend more on the split (a sample, a
# connection per range) than the ranges save.
_MIN_RANGE_CHUNKS = 8
# The split points come from the keys of about this many heap pages, sampled (TABLESAMPLE SYSTEM: whole pages).
_SAMPLE_PAGES = 256
# A table is read in as many block ranges as there are workers when each gets at least this many blocks (8 MB).
_MIN_RANGE_BLOCKS = 1024
# The most tuples a heap page holds (MaxHeapTuplesPerPage for 8 kB pages): a table with fewer pages than the
# split needs rows for cannot be worth sampling.
_MAX_TUPLES_PER_PAGE = 291


class Snapshotter:
    def __init__(self, ctx: CaptureContext, attached: Attached, writer: BatchWriter, state: CaptureState) -> None:
        self.ctx = ctx
        self.attached = attached
        self.writer = writer
        self.state = state
        assert state.snapshot is not None
        self.snap: SnapshotState = state.snapshot
        self.settings = ctx.settings
        self._gaps: dict[str, GapDeletes] = {}  # tables whose topics held live keys before this snapshot
        self._done_tables = 0

    def run(self, snapshot_name: str | None) -> None:
        tables = [t for t in self.attached.report.tables if not self.snap.table_done(t.qualified)]
        consistent = self.snap.consistent_lsn
        codecs = {t.qualified: self._codec(t) for t in tables}
        # Before anything is written: the keys live in each table's topic, to delete those the source no
        # longer has when the table's snapshot ends (cdc/_resnapshot.py; nothing is read for an empty topic).
        reconciler = Reconciler(self.ctx.settings)
        try:
            for t in tables:
                gaps = reconciler.prepare(t.qualified, codecs[t.qualified], self.snap.table(t.qualified))
                if gaps is not None:
                    self._gaps[t.qualified] = gaps
            self._run(tables, codecs, consistent, snapshot_name)
        finally:
            reconciler.close()

    def _run(
        self, tables: list[TableInfo], codecs: dict[str, TableCodec], consistent: int, snapshot_name: str | None
    ) -> None:
        chunks: queue.Queue[Chunk | BaseException] = queue.Queue(maxsize=4)
        cancel = threading.Event()
        progress, tasks = self._display(tables)
        log.info(
            "snapshot of %d table(s) at %X%s; COPY read through %s, events produced through %s",
            len(tables),
            consistent,
            "" if snapshot_name else " (resumed with a fresh snapshot)",
            "libpq from C" if copy_reader() is not None else "psycopg",
            "librdkafka from C" if self.writer.produces_from_c else "Producer.produce()",
        )

        def worker(r: ReadRange) -> None:
            try:
                self._read_range(r, codecs[r.table.qualified], snapshot_name, chunks, cancel)
            except BaseException as exc:
                chunks.put(exc)
                raise

        left, work = self._plan(tables, exported=snapshot_name is not None)
        with (
            progress,
            ThreadPoolExecutor(self.settings.capture.snapshot_workers, "snapshot") as pool,
            contextlib.ExitStack() as finish,
        ):
            finish.callback(self.ctx.metrics.snapshot_finished)
            # Tables with every range read but not finished (a stop during their gap deletes) first: while the
            # topic is scanned the workers would hold their snapshots open, blocked on the full queue.
            for t in tables:
                if not left[t.qualified]:
                    self._end_table(t.qualified, consistent)
                    self._table_done(t.qualified, 0)
            futures = [pool.submit(worker, w) for w in work]
            try:
                while any(left.values()):
                    item = chunks.get()
                    if isinstance(item, BaseException):
                        raise item
                    self._take(item, left, codecs[item.table], consistent)
                    progress.advance(tasks[item.table], item.rows)
            except BaseException:
                cancel.set()
                while not all(f.done() for f in futures):  # unblock workers waiting on a full queue
                    with contextlib.suppress(queue.Empty):
                        chunks.get(timeout=0.1)
                raise
        self.snap.status = "done"
        self.writer.commit(self.state)
        log.info("snapshot done")

    def _display(self, tables: list[TableInfo]) -> tuple[Progress, dict[str, TaskID]]:
        """A progress bar per table (on a terminal), from the tables' estimated rows, which the metrics get too."""
        progress = Progress(
            TextColumn("snapshot {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            disable=not sys.stderr.isatty(),
            transient=False,
        )
        estimates = {t.qualified: self._estimate(t) for t in tables}
        self.ctx.metrics.snapshot_started(estimates)
        return progress, {t.qualified: progress.add_task(t.qualified, total=estimates[t.qualified]) for t in tables}

    def _plan(self, tables: list[TableInfo], *, exported: bool) -> tuple[dict[str, set[int]], list[ReadRange]]:
        """The ranges still to read, table by table (each table's parts left, and the work in the order the workers
        take it: the ranges of one large table are read at once)."""
        left: dict[str, set[int]] = {}
        work: list[ReadRange] = []
        for t in tables:
            ranges = self._ranges(t, exported=exported)
            left[t.qualified] = {i for i, r in enumerate(ranges) if not r.done}
            work += [ReadRange(t, i, r.after, r.upto, r.blocks, r.filenode) for i, r in enumerate(ranges) if not r.done]
        return left, work

    def _take(self, chunk: Chunk, left: dict[str, set[int]], codec: TableCodec, consistent: int) -> None:
        """A chunk read by a worker: written (and committed when due), counted; a stop request commits what is
        written and stops the snapshot."""
        table_done = False
        if chunk.done:
            left[chunk.table].discard(chunk.part)
            table_done = not left[chunk.table]
        self._write_chunk(chunk, codec, consistent, table_done=table_done)
        if table_done:
            self._table_done(chunk.table, chunk.rows)
        else:
            self.ctx.metrics.snapshot_rows(chunk.table, chunk.rows, table_done=False, done_tables=self._done_tables)
        if self.ctx.stop.is_set():
            if self.writer.in_batch:  # the stop came after _write_chunk looked: commit
                self.writer.commit(self.state)
            log.info("stop requested during the snapshot; it resumes on the next start")
            raise SnapshotStoppedError

    def _table_done(self, table: str, rows: int) -> None:
        self._done_tables += 1
        self.ctx.metrics.snapshot_rows(table, rows, table_done=True, done_tables=self._done_tables)

    def _codec(self, table: TableInfo) -> TableCodec:
        key = set(self.attached.report.key_columns[table.qualified])
        cols = [ColumnSpec(c.name, c.type_oid, c.typmod, c.attnum) for c in table.columns]
        return self.attached.codecs.for_table(table.schema, table.name, cols, [c.name in key for c in cols], table.oid)

    def _estimate(self, table: TableInfo) -> int | None:
        row = self.attached.sql.execute(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = %s", (table.oid,)
        ).fetchone()
        return int(row[0]) if row and row[0] and row[0] > 0 else None

    def _ranges(self, table: TableInfo, *, exported: bool) -> list[RangeProgress]:
        """The table's ranges in its progress (``after``: the last key read, ``upto``: the range's last key,
        None for no bound; ``done``; ``blocks`` for a block range), split when the table is new to this
        snapshot. ``exported``: this snapshot is the slot's own, so the table may be read in block ranges."""
        progress = self.snap.table(table.qualified)
        ranges = progress.ranges
        if ranges is not None and any(r.blocks is not None for r in ranges) and not all(r.done for r in ranges):
            # Its block ranges were read in the snapshot that ended with the last run; in this one rows may
            # have moved between blocks (an update writes a new version elsewhere), so what was read says
            # nothing about what is left. From the first row, in key order, which resumes with any snapshot.
            log.info(
                "snapshot of %s starts again from its first row, in key order: it was interrupted while read in "
                "block ranges, which hold only in the snapshot they began in",
                table.qualified,
            )
            ranges = None
        if ranges is None and exported and progress.legacy_after is None:
            found = self._block_ranges(table)
            if found is not None:
                filenode, blocks = found
                ranges = [RangeProgress(blocks=b, filenode=filenode) for b in blocks]
                progress.ranges = ranges
        if ranges is None:
            # A table begun by a version that read each table in one range has its last key here.
            bounds = [] if progress.legacy_after is not None else self._split(table)
            lows: list[list[str] | None] = [progress.legacy_after, *bounds]
            highs: list[list[str] | None] = [*bounds, None]
            ranges = [RangeProgress(after=lo, upto=hi) for lo, hi in zip(lows, highs, strict=True)]
            progress.ranges = ranges
            progress.legacy_after = None  # one place for the position: the range
        return ranges

    def _block_ranges(self, table: TableInfo) -> tuple[int, list[list[int | None]]] | None:
        """The table's file now, and block ranges that cover every block of ``table`` (the last one open-ended),
        one per worker for a table large enough; or None when it is to be read in key order: over
        ``snapshot_scan_max_mb``, partitioned (its blocks are its partitions'), without the C build (which
        streams a COPY in parts), or when its size cannot be read."""
        most_mb = self.settings.capture.snapshot_scan_max_mb
        if most_mb <= 0 or table.relkind != "r" or copy_reader() is None:
            return None
        conn = self.attached.sql
        try:
            row = conn.execute(
                "SELECT pg_table_size(%(t)s::oid), pg_relation_size(%(t)s::oid) / current_setting('block_size')::int,"
                " pg_relation_filenode(%(t)s::oid)",
                {"t": table.oid},
            ).fetchone()
        except psycopg.Error as exc:
            log.info("snapshot of %s in key order: its size could not be read: %s", table.qualified, exc)
            return None
        if row is None or row[2] is None:
            return None
        size, blocks, filenode = int(row[0] or 0), int(row[1] or 0), int(row[2])
        if size > most_mb << 20:
            log.info(
                "snapshot of %s in key order: its %d MB are over capture.snapshot_scan_max_mb (%d), so that an "
                "interruption does not read it again from its first row",
                table.qualified,
                size >> 20,
                most_mb,
            )
            return None
        # A TID range scan (PostgreSQL 14+) reads only its blocks; before, a ctid condition scans the whole table.
        workers = self.settings.capture.snapshot_workers
        enough = conn.info.server_version >= 140000 and blocks >= workers * _MIN_RANGE_BLOCKS
        parts = workers if enough else 1
        log.info(
            "snapshot of %s: %d block range(s) of the slot's snapshot read at once (%d MB; if interrupted, the "
            "table is read again)",
            table.qualified,
            parts,
            size >> 20,
        )
        return filenode, block_cuts(blocks, parts)

    def _split(self, table: TableInfo) -> list[list[str]]:
        """Keys (as text) that split ``table`` into up to ``snapshot_workers`` ranges of about the same number of
        rows, from the keys of a sample of its pages; none for a table too small to be worth it. Balance is all
        they are for: the ranges cover every key whatever they are, and a failed sample costs only the split."""
        workers = self.settings.capture.snapshot_workers
        range_rows = _MIN_RANGE_CHUNKS * self.settings.capture.snapshot_chunk_rows  # the least a range may hold
        if workers < 2:
            return []
        conn = self.attached.sql
        keys = self.attached.report.key_columns[table.qualified]
        try:
            # A partitioned table's pages are its partitions' (pg_partition_tree, PostgreSQL 12+, lists nothing
            # for a plain table and a partition itself for a partition; before 12 a partitioned one is not split).
            own = "pg_relation_size(%(t)s::oid)"
            tree = "(SELECT sum(pg_relation_size(relid)) FROM pg_partition_tree(%(t)s::oid::regclass))"
            size = f"coalesce({tree}, {own})" if conn.info.server_version >= 120000 else own
            row = conn.execute(f"SELECT {size} / current_setting('block_size')::int", {"t": table.oid}).fetchone()
            pages = int(row[0]) if row and row[0] else 0
            if pages * _MAX_TUPLES_PER_PAGE < 2 * range_rows:
                return []
            percent = min(100.0, 100.0 * _SAMPLE_PAGES / pages)
            order = sql.SQL(", ").join(sql.SQL("src.{}").format(sql.Identifier(k)) for k in keys)
            sample = conn.execute(
                sql.SQL("SELECT {} FROM {} AS src TABLESAMPLE SYSTEM ({}) ORDER BY {}").format(
                    sql.SQL(", ").join(sql.SQL("src.{}::text").format(sql.Identifier(k)) for k in keys),
                    table.ident(),
                    sql.Literal(percent),
                    order,
                )
            ).fetchall()
        except psycopg.Error as exc:
            log.info("snapshot of %s reads it in one range: its keys could not be sampled: %s", table.qualified, exc)
            return []
        estimated_rows = int(len(sample) * 100.0 / percent)
        parts = min(workers, estimated_rows // range_rows)
        if parts < 2:
            return []
        # Keys are unique and sorted, so the bounds are distinct and ascending.
        bounds = [[str(v) for v in sample[i * len(sample) // parts]] for i in range(1, parts)]
        # The bounds are row values: not logged (a key can be personal data).
        log.info(
            "snapshot of %s: %d key ranges read at once (split by %d sampled keys)", table.qualified, parts, len(sample)
        )
        return bounds

    def _read_range(
        self,
        work: ReadRange,
        codec: TableCodec,
        snapshot_name: str | None,
        out: queue.Queue[Chunk | BaseException],
        cancel: threading.Event,
    ) -> None:
        if cancel.is_set():  # stopped before this range began: no connection, no snapshot to import
            return
        with psycopg.connect(self.settings.source.conninfo(), autocommit=False) as conn:
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            if snapshot_name:
                conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
            job = RangeJob(
                work,
                codec,
                most_rows=self.settings.capture.snapshot_chunk_rows,
            )
            if work.blocks is not None:
                copies = open_copies(conn)
                assert isinstance(copies, LibpqCopies)  # block ranges are made only with the C build
                self._stream_blocks(conn, job, copies, out, cancel)
                return
            keyset = Keyset.of(conn, job, self.attached.report.key_columns[work.table.qualified])
            read_keyset(conn, job, keyset, out, cancel)

    @staticmethod
    def _stream_blocks(
        conn: psycopg.Connection[Any],
        job: RangeJob,
        copies: LibpqCopies,
        out: queue.Queue[Chunk | BaseException],
        cancel: threading.Event,
    ) -> None:
        """A block range in one COPY, unordered (what a sequential scan finds), handed on in chunks of up to
        ``most_rows`` rows and ~8 MB. The chunks carry no resume position: the range is done with its last."""
        work = job.work
        assert work.blocks is not None
        table = work.table
        low, high = work.blocks
        # A table rewritten between the reads of two of its ranges (VACUUM FULL, CLUSTER, TRUNCATE, a column
        # type change) keeps every row the snapshot sees, in other blocks: a range read after it would miss rows
        # that moved into a range read before. Its file tells; held under this lock until this range is read.
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(table.ident()))
        row = conn.execute("SELECT pg_relation_filenode(%s::oid)", (table.oid,)).fetchone()
        if work.filenode is not None and (row is None or row[0] != work.filenode):
            raise TableRewrittenError(
                f"snapshot of {table.qualified}: the table was rewritten (VACUUM FULL, CLUSTER, TRUNCATE or an "
                "ALTER TABLE) while it was read in block ranges; after the restart it is read again from its "
                "first row, in key order"
            )
        conditions: list[sql.Composable] = []
        if low:
            conditions.append(sql.SQL("src.ctid >= {}::tid").format(sql.Literal(f"({low},0)")))
        if high is not None:
            conditions.append(sql.SQL("src.ctid < {}::tid").format(sql.Literal(f"({high},0)")))
        conditions += filter_condition(table)
        copies.send(
            sql.SQL("COPY (SELECT {} FROM {} AS src {}) TO STDOUT (FORMAT binary)").format(
                sql.SQL(", ").join(job.select_cols), table.ident(), where_all(conditions)
            )
        )
        done = False
        try:
            while not done and not cancel.is_set():
                data, done = copies.receive_part(job.most_rows)
                # No resume key to find first, as key order must: the encoder counts the rows.
                out.put(job.chunk(data, None, done))
        finally:
            if not done:
                copies.abandon_stream()

    def _write_chunk(self, chunk: Chunk, codec: TableCodec, consistent: int, *, table_done: bool) -> None:
        gaps = self._gaps.get(chunk.table)
        pos = Position(consistent, consistent, time.time_ns() // 1000, None, "true")
        now_us = time.time_ns() // 1000
        prefix, suffix = codec.read_event_frame(pos, now_us)
        for row in chunk.refused:  # first: under the "stop" policy nothing of the chunk is written
            self._refuse(codec, row, consistent)
        self.writer.produce_packed(codec.topic, chunk.packed, chunk.rows, prefix, suffix)
        if gaps is not None:
            gaps.seen(packed_keys(chunk.packed))
        self.ctx.metrics.count(codec.topic, "r", chunk.rows)
        # The range's entry is updated in place: the table's entry also holds the re-snapshot's start offsets
        # ("since"), kept until the table is done.
        ranges = self.snap.tables[chunk.table].ranges
        assert ranges is not None  # made by _ranges before any chunk is read
        ranges[chunk.part].after, ranges[chunk.part].done = chunk.last_key, chunk.done
        if table_done and gaps is None:
            self._forget(chunk.table)
        # The rows and the progress that covers them are committed together, every interval rather than every
        # chunk: a commit waits until Kafka has every event of its transaction, and nothing is sent meanwhile.
        interval = self.settings.capture.snapshot_commit_interval_s
        if table_done or self.writer.batch_age(time.monotonic()) >= interval or self.ctx.stop.is_set():
            self.writer.commit(self.state)
        if table_done and gaps is not None:
            self._end_table(chunk.table, consistent)

    def _refuse(self, codec: TableCodec, row: CopyRowRefused, consistent: int) -> None:
        """A snapshot row no encoder takes, to capture.on_unencodable (a stop naming it, or its dead letter)."""
        refuse_read(self.attached.dead_letters, codec, row, consistent, writer=self.writer, metrics=self.ctx.metrics)

    def _end_table(self, table: str, consistent: int) -> None:
        """Every range of ``table`` is read and committed: the keys the snapshot did not find are deleted, if its
        topic held any before, and the table is done."""
        gaps = self._gaps.get(table)
        if gaps is not None:
            self._delete_gaps(table, gaps, consistent)
        self._forget(table)
        self.writer.commit(self.state)

    def _forget(self, table: str) -> None:
        """``table`` is done: its entry keeps no more than that. The state is written with every commit while
        streaming, and its ranges hold key values."""
        self.snap.tables[table] = TableProgress(done=True)

    def _delete_gaps(self, table: str, gaps: GapDeletes, consistent: int) -> None:
        """The keys live in the topic that the snapshot did not find: deleted, in transactions that carry the
        snapshot's progress (the table still not done), so a crash leaves whole batches and the rerun, which
        reads the topic again, deletes only what is left."""

        def commit(deleted: int) -> None:
            self.ctx.metrics.count(gaps.codec.topic, "d", deleted)  # counted when committed, as streamed ones
            self.writer.commit(self.state)

        deleted = gaps.emit(
            produce=self.writer.produce,
            commit=commit,
            consistent_lsn=consistent,
            batch=self.settings.capture.snapshot_chunk_rows,
        )
        del self._gaps[table]
        log.info(
            "re-snapshot of %s: %d row(s) deleted while nothing streamed (a lost slot, a detach) were tombstoned",
            table,
            deleted,
        )


class TableRewrittenError(TransientError):
    """A table was rewritten while it was read in block ranges: the capture restarts, and reads it in key order."""


class SnapshotStoppedError(Exception):
    """The snapshot was interrupted on request; its progress is committed."""
