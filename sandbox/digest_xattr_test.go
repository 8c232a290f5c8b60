package sandbox_test

import (
	"fmt"
	"io/fs"
	"maps"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/sandbox"
)

// A sandbox's own xattrs in overlayfs's user namespace (user.overlay.opaque and the like,
// which the runtime's overlays do not act on) are hashed as any other and hide nothing: the
// index of a checkpoint is, path by path, the tree a restore of it shows, walked and hashed
// as it is seen; a sandbox that emptied the directory holds another state.
func TestStateDigestHostileXattrs(t *testing.T) {
	b := setup(t)
	ctx := t.Context()
	s := b.create(t, sandbox.Spec{})
	sh(t, s, "mkdir -p /w/d/sub /w/e; for i in $(seq 1 20); do echo $i > /w/d/f$i; done; echo y > /w/d/sub/y; ln -s f1 /w/d/l; echo e > /w/e/x")
	base, _ := ckDigest(t, b, s)
	sh(t, s, "echo new > /w/d/new; echo z > /w/d/sub/z")
	root := fmt.Sprintf("/proc/%d/root", s.InitPid())
	for _, x := range []struct{ path, name, value string }{
		{"/w/d", "user.overlay.opaque", "y"},
		{"/w/d", "user.overlay.redirect", "/etc"},
		{"/w/d", "user.overlay.origin", "\x00\xfb\x21"},
		{"/w/d", "user.overlay.impure", "y"},
		{"/w/d", "user.mine", "1"},
		{"/w/d/sub", "user.overlay.opaque", "y"},
		{"/w/d/f2", "user.overlay.opaque", "y"},
		{"/w/d/f3", "user.overlay.metacopy", ""},
		{"/w/e", "user.overlay.opaque", "y"}, // a directory of a lower layer only, copied up
	} {
		if err := unix.Lsetxattr(root+x.path, x.name, []byte(x.value), 0); err != nil {
			t.Fatalf("setting %s on %s: %v", x.name, x.path, err)
		}
	}
	ck1, d1 := ckDigest(t, b, s)

	s2 := b.create(t, sandbox.Spec{Checkpoint: ck1.ID})
	root2 := fmt.Sprintf("/proc/%d/root", s2.InitPid())
	var st unix.Stat_t
	if err := unix.Stat(root2+"/", &st); err != nil {
		t.Fatal(err)
	}
	want := map[string]sandbox.IndexEntry{}
	err := filepath.WalkDir(root2+"/w", func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root2+"/w", p)
		want[rel], err = sandbox.EntryOf(p, st.Uid)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if want["d/f20"] == (sandbox.IndexEntry{}) || want["d/sub/y"] == (sandbox.IndexEntry{}) {
		t.Fatalf("the restore does not show the lower layer's files: %v", slices.Sorted(maps.Keys(want)))
	}
	got, err := b.rt.IndexBelow(ctx, ck1.ID, "/w")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range slices.Sorted(maps.Keys(want)) {
		if g, ok := got[p]; !ok {
			t.Errorf("%s: shown by the restore, not in the index", p)
		} else if g != want[p] {
			t.Errorf("%s: index entry differs from what the restore shows", p)
		}
	}
	for p := range got {
		if _, ok := want[p]; !ok {
			t.Errorf("%s: in the index, not shown by the restore", p)
		}
	}

	// Only the marks changed since base: no path is removed.
	diff, err := b.rt.DiffCheckpoints(ctx, base.ID, ck1.ID, sandbox.DiffOptions{Path: "/w", Detail: sandbox.DiffLines})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range diff.Paths {
		if c.Kind == sandbox.ChangeRemoved {
			t.Errorf("%s: reported removed", c.Path)
		}
	}

	// Emptied, the directory is another state: no dedupe into ck1.
	sh(t, s2, "rm -rf /w/d/* /w/e/*")
	ck2, d2 := ckDigest(t, b, s2)
	if d2.Files == d1.Files {
		t.Fatal("an emptied directory hashes as the full one marked opaque")
	}
	if found, dup, err := b.rt.Dedupe(ctx, ck2.ID, nil); err != nil || dup {
		t.Fatalf("dedupe of the emptied state: found %s dup %v err %v", found.ID, dup, err)
	}
}
