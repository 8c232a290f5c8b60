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

// The text of an error without its class's words: once in the middle, at either end, twice, and
// those of another class kept.
func TestMessage(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{fmt.Errorf("env shell: checkpointing task: %w: the server's cap %q of 2 would be exceeded", ErrResourceExhausted, "checkpoints"),
			`env shell: checkpointing task: the server's cap "checkpoints" of 2 would be exceeded`},
		{fmt.Errorf("env x: setup[0]: exited 1: env not ready: %w", ErrFailedPrecondition), "env x: setup[0]: exited 1: env not ready"},
		{fmt.Errorf("%w: checkpoint ck", ErrNotFound), "checkpoint ck"},
		{fmt.Errorf("env x: %w: %w", fmt.Errorf("not ready: %w", ErrFailedPrecondition), fmt.Errorf("image y: %w", ErrNotFound)),
			"env x: not ready: image y: not found"},
		{fmt.Errorf("a: %w: b: %w", ErrAborted, ErrAborted), "a: b"},
		{fmt.Errorf("file: not found here: %w", ErrNotFound), "file: not found here"},
		{fmt.Errorf("%w", ErrNotFound), "not found"},
		{errors.New("plain: not found"), "plain: not found"},
		{nil, ""},
	} {
		if got := Message(tc.err); got != tc.want {
			t.Errorf("Message(%q) = %q, want %q", tc.err, got, tc.want)
		}
	}
}

func TestDetail(t *testing.T) {
	inner := WithDetail(fmt.Errorf("checkpoint c: %w", ErrNotFound), "CHECKPOINT_NOT_FOUND", "checkpoint_id", "c", "env", "inner")
	outer := WithDetail(fmt.Errorf("restoring: %w", inner), "", "sandbox_id", "s", "env", "outer")
	if outer.Error() != "restoring: checkpoint c: not found" || Class(outer) != ErrNotFound || !errors.Is(outer, ErrNotFound) {
		t.Fatalf("a detail changed the error: %q, class %v", outer, Class(outer))
	}
	d := DetailOf(fmt.Errorf("x: %w", outer))
	want := map[string]string{"checkpoint_id": "c", "sandbox_id": "s", "env": "outer"}
	if d.Reason != "CHECKPOINT_NOT_FOUND" || fmt.Sprint(d.Meta) != fmt.Sprint(want) {
		t.Fatalf("DetailOf = %+v, want the inner reason and %v", d, want)
	}
	// Across a join, the first branch's reason wins.
	j := errors.Join(WithDetail(ErrNotFound, "A"), WithDetail(ErrNotFound, "B", "k", "v"))
	if d := DetailOf(j); d.Reason != "A" || d.Meta["k"] != "v" {
		t.Fatalf("DetailOf of a join = %+v", d)
	}
	if d := DetailOf(errors.New("plain")); d.Reason != "" || d.Meta != nil || WithDetail(nil, "R") != nil {
		t.Fatalf("DetailOf of a plain error = %+v", d)
	}
}
