package layers

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// ErrNotFound is returned for a layer the store does not hold.
var ErrNotFound = fmt.Errorf("layer not found: %w", errdefs.ErrNotFound)

// notFound is the error for layer id, which the store does not hold.
func notFound(id string) error { return fmt.Errorf("%w: %s", ErrNotFound, id) }
