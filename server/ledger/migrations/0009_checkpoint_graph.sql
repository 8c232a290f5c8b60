-- The state digests of checkpoints (recorded once computed, after the checkpoint: kept apart
-- from the checkpoint's row so that either may arrive first) and the extra parent links of the
-- checkpoint graph: a deduplicating Checkpoint that found the sandbox's state in an existing
-- checkpoint links the sandbox's previous checkpoint (parent_id) to it (child_id).
CREATE TABLE checkpoint_digests (
	id        text PRIMARY KEY,
	files     text NOT NULL,
	processes text NOT NULL DEFAULT ''
);

CREATE TABLE checkpoint_edges (
	child_id   text NOT NULL,
	parent_id  text NOT NULL,
	created_at timestamptz NOT NULL,
	PRIMARY KEY (child_id, parent_id)
);
CREATE INDEX checkpoint_edges_parent_idx ON checkpoint_edges (parent_id);
