-- Compress a step's action with lz4, as its observation is, not with pglz, PostgreSQL's
-- default.
--
-- An action is compressed when its row is over the 2032-byte TOAST target once the
-- observation is: a write_file of a few KiB (its content base64 in the action's JSON) with a
-- small observation, say. pglz_compress was 1.5% of all the machine's CPU under the rollback
-- load test with the ledger on (4 KiB writes, perf); BenchmarkCopyCost's write-action
-- variants compare the two. Only rows written from now on change; rows already stored stay
-- readable as they are.
ALTER TABLE steps ALTER COLUMN action SET COMPRESSION lz4;
