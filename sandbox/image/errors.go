package image

import (
	"fmt"

	"github.com/deltagym/deltagym/internal/errdefs"
)

var (
	// ErrUnknownFormat means the source is neither an OCI image layout, a docker save tarball
	// nor a directory.
	ErrUnknownFormat = fmt.Errorf("unknown image format: %w", errdefs.ErrInvalidArgument)
	// ErrInvalidImage means the source has the right shape but its index, manifest or config
	// is malformed, missing, or names more than one image.
	ErrInvalidImage = fmt.Errorf("invalid image: %w", errdefs.ErrInvalidArgument)
	// ErrDigestMismatch means a blob or layer does not hash to the digest that names it.
	ErrDigestMismatch = fmt.Errorf("digest mismatch: %w", errdefs.ErrInvalidArgument)
	// ErrUnsafePath means a layer entry would be written outside the layer directory: an
	// absolute name, a ".." component, or a path through a symlink.
	ErrUnsafePath = fmt.Errorf("unsafe path in layer: %w", errdefs.ErrInvalidArgument)
	// ErrUnsupportedCompression means a layer is compressed with something other than gzip.
	ErrUnsupportedCompression = fmt.Errorf("unsupported layer compression: %w", errdefs.ErrInvalidArgument)
	// ErrUnsupportedEntry means a layer holds a tar entry type that cannot be reproduced.
	ErrUnsupportedEntry = fmt.Errorf("unsupported tar entry: %w", errdefs.ErrInvalidArgument)
	// ErrDirNotEmpty means the destination of an import is not an empty directory.
	ErrDirNotEmpty = fmt.Errorf("import directory is not empty: %w", errdefs.ErrAlreadyExists)
	// ErrTooLarge means an import would write more than its cap (WithMaxBytes).
	ErrTooLarge = fmt.Errorf("image too large: %w", errdefs.ErrResourceExhausted)
	// ErrNotImported means a directory holds no completed import.
	ErrNotImported = fmt.Errorf("no imported image: %w", errdefs.ErrNotFound)
)
