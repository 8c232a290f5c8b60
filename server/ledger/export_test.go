package ledger

// Buffered returns the bytes of rows waiting for the next group commit. It drops when the syncer
// takes the window for a spool write, which is how TestSIGKILLLosesAtMostOneWindow sees when
// the write+fsync in flight at the kill began.
func (w *Writer) Buffered() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pending
}
