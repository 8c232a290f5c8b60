-- Never try to compress a step's ids and hash.
--
-- A 4 KiB observation compressed with lz4 still leaves its row over the 2032-byte TOAST
-- target, so PostgreSQL goes on to try every other MAIN column over 24 bytes, biggest first:
-- the action (lz4), then the observation's SHA-256 and the episode id (pglz, the default
-- method). A hash and the server's random hex ids never compress. Without the attempts a COPY
-- backend spent 0.35-0.95 µs less per row (three interleaved pairs; BenchmarkCopyCost's
-- ids-main variant keeps the columns MAIN, as before this migration).
--
-- PLAIN columns are never compressed nor moved out of line. The writer refuses ids over 1 KiB
-- and a hash that is not 32 bytes (ErrInvalid), so the three always fit a page, and a big
-- observation or action is still moved to TOAST when the row needs it. The action stays MAIN:
-- a write_file's is worth compressing. Only rows written from now on change. A row whose ids
-- outgrow a page (from a spool an older writer left, which took any id) is refused by Postgres
-- and dropped with a log line, as any row Postgres refuses; the server's ids are under 40 bytes.
ALTER TABLE steps
	ALTER COLUMN episode_id SET STORAGE PLAIN,
	ALTER COLUMN observation_sha256 SET STORAGE PLAIN,
	ALTER COLUMN checkpoint_id SET STORAGE PLAIN;
