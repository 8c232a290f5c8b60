package image

import (
	"context"
	"fmt"
	"io"
)

// entryCost is what every entry of an import is charged besides its contents: a tar header's
// size, so that a flood of empty files is bounded too.
const entryCost = 512

// Option adjusts an import.
type Option func(*options)

type options struct {
	maxBytes int64
}

// WithMaxBytes caps what an import may write: the contents of its files after decompression,
// a gzip-compressed archive's decompressed copy, and entryCost per entry. An import over the
// cap fails with ErrTooLarge and leaves nothing behind. n <= 0 means no cap.
func WithMaxBytes(n int64) Option { return func(o *options) { o.maxBytes = n } }

// budget is what is left of an import's cap; a nil budget is unlimited. Besides what is
// written (left), the bytes decompressed from layer blobs are counted (unpacked), whether they
// are written or skipped (data after a tar's end, entries that are not files), so that a small
// blob cannot keep the server decompressing for long either.
type budget struct {
	max, left int64
	unpacked  int64
}

func newBudget(max int64) *budget {
	if max <= 0 {
		return nil
	}
	return &budget{max: max, left: max}
}

// unpack counts n decompressed bytes.
func (b *budget) unpack(n int64) error {
	if b == nil {
		return nil
	}
	b.unpacked += n
	if b.unpacked > b.max {
		return fmt.Errorf("the import unpacks more than its cap of %d bytes: %w", b.max, ErrTooLarge)
	}
	return nil
}

// unpackReader counts what it reads with budget.unpack, and stops when ctx ends.
type unpackReader struct {
	ctx context.Context
	r   io.Reader
	b   *budget
}

func (u *unpackReader) Read(p []byte) (int, error) {
	if err := u.ctx.Err(); err != nil {
		return 0, err
	}
	n, err := u.r.Read(p)
	if uerr := u.b.unpack(int64(n)); uerr != nil {
		return n, uerr
	}
	return n, err
}

// take charges n bytes, or fails with ErrTooLarge when fewer are left.
func (b *budget) take(n int64) error {
	if b == nil {
		return nil
	}
	if n > b.left {
		b.left = 0
		return fmt.Errorf("the import writes more than its cap of %d bytes: %w", b.max, ErrTooLarge)
	}
	b.left -= n
	return nil
}

// remaining returns what is left (-1 when unlimited).
func (b *budget) remaining() int64 {
	if b == nil {
		return -1
	}
	return b.left
}
