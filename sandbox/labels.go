package sandbox

import (
	"fmt"
	"maps"
	"slices"
)

// Checkpoint labels are the caller's key-value pairs on a checkpoint (CheckpointOptions.Labels,
// SetCheckpointLabels): what the checkpoint is to its user (the server keeps where an episode
// took it). They live in the checkpoint's record in the data directory, so they survive a
// restart, and go with the record when the checkpoint is released or expires. Callers get
// copies; the record's map is read and replaced under Runtime.mu.

// cloneLabels copies labels (nil for none).
func cloneLabels(labels map[string]string) map[string]string {
	if len(labels) == 0 {
		return nil
	}
	return maps.Clone(labels)
}

// SetCheckpointLabels adds labels to checkpoint id's (a key it has already gets the new value)
// and writes its record again.
func (r *Runtime) SetCheckpointLabels(id string, labels map[string]string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.ckpts[id]
	if c == nil {
		return fmt.Errorf("%w: checkpoint %q: unknown or released checkpoint", ErrNotFound, id)
	}
	old := c.Labels
	next := make(map[string]string, len(old)+len(labels))
	maps.Copy(next, old)
	maps.Copy(next, labels)
	c.Labels = next
	if err := r.writeCheckpoint(c); err != nil {
		c.Labels = old
		return err
	}
	return nil
}

// CheckpointsWithout returns the ids of the checkpoints whose labels lack key, sorted.
func (r *Runtime) CheckpointsWithout(key string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var ids []string
	for id, c := range r.ckpts {
		if _, ok := c.Labels[key]; !ok {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}
