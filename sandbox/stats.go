package sandbox

// DiscardBacklog returns the number of released delta layers whose discard
// (a lazy unmount and removal, run in the background) has not finished yet.
// A backlog that grows during a steady load means discards fall behind.
func (r *Runtime) DiscardBacklog() int { return r.layers.Pending() }

// CheckpointBytes returns the bytes charged to the checkpoint budget: every
// sealed layer and every checkpoint's CRIU images.
func (r *Runtime) CheckpointBytes() int64 { return r.layers.SealedBytes() + r.pimg.bytes.Load() }

// CapUse is one cap in force and what counts against it now.
type CapUse struct {
	Cap        Cap
	Limit, Use int64
}

// CapUses returns the caps in force (those not 0) with their use: live
// sandboxes (closed ones not yet torn down included), checkpoints, the
// bytes charged to the checkpoint budget, the server's descriptors (counted
// now, from /proc/self/fd) and the layer mounts.
func (r *Runtime) CapUses() []CapUse {
	c := r.Caps()
	var out []CapUse
	add := func(cp Cap, limit int64, use func() int64) {
		if limit > 0 {
			out = append(out, CapUse{Cap: cp, Limit: limit, Use: use()})
		}
	}
	add(CapSandboxes, int64(c.Sandboxes), func() int64 { return int64(r.Sandboxes()) })
	add(CapCheckpoints, int64(c.Checkpoints), func() int64 { return int64(r.Checkpoints()) })
	add(CapCheckpointBytes, r.cfg.CheckpointBudgetBytes, r.CheckpointBytes)
	add(CapDescriptors, int64(c.Descriptors), func() int64 {
		n, _ := openFDs()
		return int64(n)
	})
	add(CapMounts, int64(c.Mounts), func() int64 { return int64(r.layers.Mounts()) })
	return out
}
