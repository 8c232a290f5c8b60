-- Trajectory ledger: runs, episodes, steps, rewards and the checkpoint tree.
-- No foreign keys: rows arrive asynchronously from the writer's spool, and the ledger is an
-- append-only record that must accept every row it is given.

CREATE TABLE runs (
	name       text PRIMARY KEY,
	created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE episodes (
	id               text PRIMARY KEY,
	env              text NOT NULL,
	run              text NOT NULL DEFAULT '',
	group_id         text NOT NULL DEFAULT '',
	seed             bigint NOT NULL DEFAULT 0,
	start_checkpoint text,
	parent_episode   text,
	status           text NOT NULL DEFAULT 'running'
		CHECK (status IN ('running', 'terminated', 'truncated', 'branched', 'failed')),
	failure_class    text CHECK (failure_class IN ('infra', 'agent', 'verifier')),
	total_reward     double precision,
	started_at       timestamptz NOT NULL,
	ended_at         timestamptz
);
CREATE INDEX episodes_run_idx ON episodes (run, started_at, id);
CREATE INDEX episodes_group_idx ON episodes (group_id, started_at, id);
CREATE INDEX episodes_env_idx ON episodes (env, started_at, id);
CREATE INDEX episodes_started_idx ON episodes (started_at, id);

CREATE TABLE steps (
	episode_id         text NOT NULL,
	idx                integer NOT NULL,
	action             jsonb NOT NULL,
	observation        bytea NOT NULL,
	observation_size   bigint NOT NULL,
	observation_sha256 bytea NOT NULL,
	reward             double precision NOT NULL DEFAULT 0,
	terminated         boolean NOT NULL DEFAULT false,
	truncated          boolean NOT NULL DEFAULT false,
	started_at         timestamptz NOT NULL,
	duration_ns        bigint NOT NULL DEFAULT 0,
	checkpoint_id      text,
	PRIMARY KEY (episode_id, idx)
);
-- Observations up to a page stay inline (lz4-compressed when it helps): no TOAST table and
-- TOAST index insert per step, which halves COPY throughput for 4 KiB observations.
ALTER TABLE steps ALTER COLUMN observation SET COMPRESSION lz4;
ALTER TABLE steps ALTER COLUMN observation SET STORAGE MAIN;

CREATE TABLE rewards (
	id         bigserial PRIMARY KEY,
	episode_id text NOT NULL,
	step_index integer,
	source     text NOT NULL,
	components jsonb NOT NULL DEFAULT '{}',
	value      double precision NOT NULL,
	created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX rewards_episode_idx ON rewards (episode_id, source, id);

CREATE TABLE checkpoints (
	id          text PRIMARY KEY,
	parent_id   text,
	kind        text NOT NULL CHECK (kind IN ('user', 'pool', 'task', 'evaluate')),
	env         text NOT NULL,
	sandbox     text NOT NULL DEFAULT '',
	episode_id  text,
	step_index  integer,
	created_at  timestamptz NOT NULL,
	released_at timestamptz
);
CREATE INDEX checkpoints_parent_idx ON checkpoints (parent_id);
CREATE INDEX checkpoints_episode_idx ON checkpoints (episode_id);

-- How far each writer spool has been delivered: updated in the same transaction as the rows,
-- so redelivery after a crash skips what was committed (exactly once).
CREATE TABLE ledger_spool_marks (
	spool_id   text PRIMARY KEY,
	seq        bigint NOT NULL,
	updated_at timestamptz NOT NULL DEFAULT now()
);
