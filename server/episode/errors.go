package episode

import (
	"errors"
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
	"github.com/deltagym/deltagym/internal/nodeid"
	"github.com/deltagym/deltagym/sandbox"
)

// Sentinel errors of the episode core. Errors of the runtime, the pools and the ledger pass
// through wrapped, so that callers test them with errors.Is too.
var (
	// ErrInvalid means a malformed request: a missing field, an action of no kind or of two.
	ErrInvalid = fmt.Errorf("invalid request: %w", errdefs.ErrInvalidArgument)
	// ErrEpisodeEnded means a step on an episode that is terminated, truncated or failed.
	ErrEpisodeEnded = fmt.Errorf("episode ended: %w", errdefs.ErrFailedPrecondition)
	// ErrOtherEnv means a restore of a checkpoint of another env than the sandbox's.
	ErrOtherEnv = fmt.Errorf("a sandbox restores only checkpoints of its own env; fork the checkpoint for sandboxes of its env: %w",
		errdefs.ErrFailedPrecondition)
	// ErrWrongNode means a call on a sandbox or checkpoint another node of the cluster holds:
	// its ID names that node (internal/nodeid).
	ErrWrongNode = fmt.Errorf("%w", errdefs.ErrFailedPrecondition)
	// ErrDraining means a Reset or Fork on a node that is draining: shutting down, it takes no
	// new sandboxes while those it holds run until their leases end.
	ErrDraining = fmt.Errorf("draining: %w", errdefs.ErrUnavailable)
)

// about returns err with metadata kv (errdefs.WithDetail), pairs of key and value naming what
// it is about: the API's error reasons carry them (sandbox_id, checkpoint_id, env).
func about(err error, kv ...string) error { return errdefs.WithDetail(err, "", kv...) }

// wrongNode returns the error of a call on id (of field, "sandbox_id" or "checkpoint_id") that
// this node does not hold, when id names another node; nil when id names this one or none.
func (c *Core) wrongNode(field, id string) error {
	owner := nodeid.Node(id)
	if owner == "" || owner == c.cfg.Node {
		return nil
	}
	where := "node " + owner
	addr := ""
	if c.cfg.NodeAddr != nil {
		if addr = c.cfg.NodeAddr(owner); addr != "" {
			where += " (" + addr + ")"
		}
	}
	return errdefs.WithDetail(fmt.Errorf("%s %s is on %s, not on this node (%s): send calls on it to its node, or use a cluster client, which does: %w",
		field[:len(field)-3], id, where, c.cfg.Node, ErrWrongNode), "WRONG_NODE", field, id, "node", owner, "address", addr)
}

// Drain makes the node take no new sandboxes: Reset and Fork fail with ErrDraining from now
// on, while the sandboxes handed out run on. Leased says when they are all gone.
func (c *Core) Drain() { c.draining.Store(true) }

// Draining reports whether Drain was called.
func (c *Core) Draining() bool { return c.draining.Load() }

// Leased returns how many sandboxes are handed out and not ended.
func (c *Core) Leased() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.boxes)
}

// drainErr is ErrDraining's error for a call that would make sandboxes, nil when not draining.
func (c *Core) drainErr(call string) error {
	if !c.draining.Load() {
		return nil
	}
	return errdefs.WithDetail(fmt.Errorf("%s refused: node %s is draining (shutting down): it takes no new sandboxes while those it holds run until their leases end; "+
		"place new work on another node: %w", call, c.cfg.Node, ErrDraining), "DRAINING", "node", c.cfg.Node)
}

// fetchable reports whether checkpoint id is another node's that this node may fetch
// (Config.Fetch).
func (c *Core) fetchable(id string) bool {
	owner := nodeid.Node(id)
	return c.cfg.Fetch != nil && owner != "" && owner != c.cfg.Node
}

// checkpointErr is err, from the runtime about checkpoint id, with its reason
// (CHECKPOINT_NOT_FOUND for the runtime's not-found, which says no more than that, or
// WRONG_NODE when id names another node) and id.
func (c *Core) checkpointErr(err error, id string) error {
	if errors.Is(err, sandbox.ErrNotFound) {
		if werr := c.wrongNode("checkpoint_id", id); werr != nil {
			return werr
		}
		return errdefs.WithDetail(err, "CHECKPOINT_NOT_FOUND", "checkpoint_id", id)
	}
	return about(err, "checkpoint_id", id)
}
