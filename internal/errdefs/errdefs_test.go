package errdefs

import (
	"errors"
	"fmt"
	"testing"
)

func TestClass(t *testing.T) {
	own := fmt.Errorf("unknown env: %w", ErrNotFound)
	for _, tc := range []struct {
		err, want error
	}{
		{fmt.Errorf("env x: %w", own), ErrNotFound},
		{fmt.Errorf("a: %w", ErrResourceExhausted), ErrResourceExhausted},
		{errors.New("plain"), nil},
		{nil, nil},
		// An error of one class caused by an error of another is of its own class.
		{fmt.Errorf("env x: %w: %w", fmt.Errorf("not ready: %w", ErrFailedPrecondition), fmt.Errorf("image: %w", ErrNotFound)), ErrFailedPrecondition},
		{fmt.Errorf("env x: %w", fmt.Errorf("not ready: %w: %w", ErrFailedPrecondition, fmt.Errorf("image: %w", ErrNotFound))), ErrFailedPrecondition},
	} {
		if got := Class(tc.err); got != tc.want {
			t.Errorf("Class(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	if !errors.Is(fmt.Errorf("x: %w", own), own) {
		t.Fatal("a package's own sentinel is lost through wrapping")
	}
}
