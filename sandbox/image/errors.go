package image

import "errors"

var (
	// ErrUnknownFormat means the source is neither an OCI image layout, a docker save tarball
	// nor a directory.
	ErrUnknownFormat = errors.New("unknown image format")
	// ErrInvalidImage means the source has the right shape but its index, manifest or config
	// is malformed, missing, or names more than one image.
	ErrInvalidImage = errors.New("invalid image")
	// ErrDigestMismatch means a blob or layer does not hash to the digest that names it.
	ErrDigestMismatch = errors.New("digest mismatch")
	// ErrUnsafePath means a layer entry would be written outside the layer directory: an
	// absolute name, a ".." component, or a path through a symlink.
	ErrUnsafePath = errors.New("unsafe path in layer")
	// ErrUnsupportedCompression means a layer is compressed with something other than gzip.
	ErrUnsupportedCompression = errors.New("unsupported layer compression")
	// ErrUnsupportedEntry means a layer holds a tar entry type that cannot be reproduced.
	ErrUnsupportedEntry = errors.New("unsupported tar entry")
	// ErrDirNotEmpty means the destination of an import is not an empty directory.
	ErrDirNotEmpty = errors.New("import directory is not empty")
	// ErrTooLarge means an import would write more than its cap (WithMaxBytes).
	ErrTooLarge = errors.New("image too large")
	// ErrNotImported means a directory holds no completed import.
	ErrNotImported = errors.New("no imported image")
)
