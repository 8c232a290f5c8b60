package sandbox

// DiscardBacklog returns the number of released delta layers whose discard
// (a lazy unmount and removal, run in the background) has not finished yet.
// A backlog that grows during a steady load means discards fall behind.
func (r *Runtime) DiscardBacklog() int { return r.layers.Pending() }

// CheckpointBytes returns the bytes charged to the checkpoint budget: every
// sealed layer and every checkpoint's CRIU images.
func (r *Runtime) CheckpointBytes() int64 { return r.layers.SealedBytes() + r.pimg.bytes.Load() }
