-- Keep every steps column except the observation inline.
--
-- 0001 made the observation MAIN, but left the small varlena columns EXTENDED. With a 4 KiB
-- observation the row is over the 2032-byte TOAST target until the observation is compressed,
-- and PostgreSQL 15 looks at EXTENDED columns first: it moved observation_sha256 (33 bytes) and
-- action (25 bytes of jsonb) out to the TOAST table, one TOAST row, TOAST index entry and OID
-- allocation each, per step. That was about a quarter of the backend's CPU during COPY
-- (perf, see mk/ledger.mk's ledger-copycost), and every trajectory read had to fetch them back.
--
-- As MAIN they are compressed only if the row is still too big after the observation is, and
-- moved out of line only when the row exceeds a page. Only rows written from now on change;
-- rows already stored stay readable as they are.
ALTER TABLE steps
	ALTER COLUMN episode_id SET STORAGE MAIN,
	ALTER COLUMN action SET STORAGE MAIN,
	ALTER COLUMN observation_sha256 SET STORAGE MAIN,
	ALTER COLUMN checkpoint_id SET STORAGE MAIN;
