// Package ledger records deltagym's trajectories in Postgres: runs, episodes, steps (with capped
// observations), rewards and the checkpoint tree, and answers the queries trainers need
// (trajectories with inherited steps, checkpoint trees, GRPO group advantages, JSONL export).
//
// Writing goes through a Writer, whose append methods never wait for Postgres: rows are
// group-committed to a durable local spool (append-only, length-prefixed, CRC-32C checksummed
// segment files, written with O_DIRECT where the file system allows it and fsynced once per
// Config.GroupCommit window; spool.go's directIO says why) and delivered asynchronously in
// batches (binary COPY for steps and rewards, batched statements for the rest) from a bounded
// in-memory queue, or read back from the spool when that queue is full. Up to Config.Conns
// batches are copied at once, on as many connections, and commit in order. Each delivery
// transaction takes the spool's advisory lock, checks the spool's mark in ledger_spool_marks
// (rolling back and redoing the batch past the mark if the mark already covers some of its rows)
// and advances the mark, so after a Postgres outage or restart, or a crash of the writer (even
// one whose last COMMIT was still in flight), rows are delivered in order, exactly once. At a
// low row rate, deliveries are gathered over Config.DeliveryDelay (default 100 ms) to spare
// Postgres a transaction and WAL fsync per group commit.
//
// Durability: a caller that must not answer before its rows are safe calls Writer.Stored, which
// has the rows appended before it written to the spool file at once (the rows of concurrent
// callers together) and waits for that write: a SIGKILL of the process then loses none of them;
// with Config.Sync it waits for their fsync too, and a crash of the machine loses none either.
// The fsync runs beside the writes; with Config.PageCache the writes go through the page cache,
// so that a caller waits for a copy into memory, not for the device.
// A graceful Close loses nothing (rows Postgres cannot take before its deadline stay in the
// spool for the next writer on the directory). Of the rows no caller waited for, a SIGKILL of
// the writing process loses at most those appended in the last group-commit window (default
// 10 ms) plus the write+fsync in flight (Stats.MaxSync); TestSIGKILLLosesAtMostOneWindow
// measures it. Appends wait only if the disk falls behind by Config.MaxPending bytes.
//
// The schema is a series of SQL migrations embedded in the binary and applied by Migrate in one
// transaction under an advisory lock. Reading goes through a Store, whose queries flush the
// writer first so they see rows appended just before.
package ledger
