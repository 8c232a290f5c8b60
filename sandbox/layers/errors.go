package layers

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

var (
	// ErrNotFound is returned for a layer the store does not hold.
	ErrNotFound = fmt.Errorf("layer not found: %w", errdefs.ErrNotFound)
	// ErrNotSealed is returned for a layer that is still writable where a
	// sealed one is needed: only a sealed layer has a digest and travels.
	ErrNotSealed = fmt.Errorf("layer not sealed: %w", errdefs.ErrFailedPrecondition)
	// ErrUntransferable is returned by Export for a layer holding what the
	// transfer format does not carry: a device node, a tree deeper than
	// its bound, extended attributes past theirs.
	ErrUntransferable = fmt.Errorf("layer cannot be transferred: %w", errdefs.ErrFailedPrecondition)
	// ErrBadDigest is returned for a digest not of the form
	// "sha256:<64 lowercase hex digits>".
	ErrBadDigest = fmt.Errorf("malformed layer digest: %w", errdefs.ErrInvalidArgument)
	// ErrBadStream is returned by Import for a stream that breaks the
	// transfer format: truncated, out of order, naming a path outside its
	// layer, a device, a bound exceeded, anything not canonical.
	ErrBadStream = fmt.Errorf("malformed layer stream: %w", errdefs.ErrInvalidArgument)
	// ErrDigestMismatch is returned by Import for a well-formed stream
	// whose digest is not the one asked for.
	ErrDigestMismatch = fmt.Errorf("layer stream digest mismatch: %w", errdefs.ErrInvalidArgument)
	// ErrLayerFull is returned by Import for a stream that does not fit the
	// layer's size or inode limit.
	ErrLayerFull = fmt.Errorf("layer stream does not fit its layer: %w", errdefs.ErrResourceExhausted)
)

// notFound is the error for layer id, which the store does not hold.
func notFound(id string) error { return fmt.Errorf("%w: %s", ErrNotFound, id) }
