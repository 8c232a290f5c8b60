-- Outbound connections of sandboxes through the egress proxy, allowed or refused: who asked
-- (env, sandbox, the episode running in it), for what (host and port as asked, the address
-- dialled or refused), the answer and why, and what went through.
CREATE TABLE egress (
	id          bigserial PRIMARY KEY,
	env         text NOT NULL,
	sandbox     text NOT NULL,
	episode_id  text,
	host        text NOT NULL,
	port        integer NOT NULL,
	address     inet,
	allowed     boolean NOT NULL,
	reason      text,
	bytes_up    bigint NOT NULL DEFAULT 0,
	bytes_down  bigint NOT NULL DEFAULT 0,
	started_at  timestamptz NOT NULL,
	duration_ns bigint NOT NULL
);
CREATE INDEX egress_episode_idx ON egress (episode_id);
CREATE INDEX egress_sandbox_idx ON egress (sandbox, started_at);
