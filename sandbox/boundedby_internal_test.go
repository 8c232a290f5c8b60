package sandbox

import "testing"

// The log names what set the sandbox cap: the flag that set it, none, or the host's bound.
func TestSandboxesBoundedBy(t *testing.T) {
	for _, c := range []struct {
		set        int
		flag, want string
	}{
		{0, "deltagym serve --max-sandboxes", "descriptors"},
		{50, "deltagym serve --max-sandboxes", "--max-sandboxes"},
		{50, "", "config"},
		{-1, "deltagym serve --max-sandboxes", "none"},
	} {
		if got := sandboxesBoundedBy(c.set, c.flag, "descriptors"); got != c.want {
			t.Errorf("cap %d set by %q: bounded by %q, want %q", c.set, c.flag, got, c.want)
		}
	}
}
