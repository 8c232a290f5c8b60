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
	} {
		if got := Class(tc.err); got != tc.want {
			t.Errorf("Class(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	if !errors.Is(fmt.Errorf("x: %w", own), own) {
		t.Fatal("a package's own sentinel is lost through wrapping")
	}
}
