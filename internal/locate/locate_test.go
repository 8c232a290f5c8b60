package locate

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// clearEnv unsets the variables that would stop a search before it looks in the checkout.
func clearEnv(t *testing.T) {
	t.Helper()
	for _, e := range []string{EnvInit, EnvCRIU, EnvPostgres} {
		t.Setenv(e, "")
	}
}

func writeFile(t *testing.T, p string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("#!/bin/sh\nexit 1\n"), mode); err != nil {
		t.Fatal(err)
	}
}

func TestCheckoutRoot(t *testing.T) {
	top := t.TempDir()
	below := filepath.Join(top, "a", "b")
	if err := os.MkdirAll(below, 0o755); err != nil {
		t.Fatal(err)
	}
	if r := checkoutRoot(below); r == top || r == below {
		t.Fatalf("checkoutRoot(%s) = %s with no go.mod in the tree", below, r)
	}
	writeFile(t, filepath.Join(top, "go.mod"), 0o644)
	if r := checkoutRoot(below); r != top {
		t.Fatalf("checkoutRoot(%s) = %q, want %s", below, r, top)
	}
	if r := checkoutRoot(top); r != top {
		t.Fatalf("checkoutRoot(%s) = %q, want itself", top, r)
	}
	t.Chdir(below)
	if r := Checkout(); r != top {
		t.Fatalf("Checkout() from %s = %q, want %s", below, r, top)
	}
}

// The variables name a program ahead of any search, and a name that is not an executable file
// is an error, not a reason to search on.
func TestNamedByEnvironment(t *testing.T) {
	clearEnv(t)
	dir := t.TempDir()
	exe := filepath.Join(dir, "prog")
	writeFile(t, exe, 0o755)
	plain := filepath.Join(dir, "plain")
	writeFile(t, plain, 0o644)
	for _, tc := range []struct {
		name, path string
		ok         bool
	}{
		{"executable", exe, true},
		{"missing", filepath.Join(dir, "nope"), false},
		{"directory", dir, false},
		{"not executable", plain, false},
	} {
		for _, f := range []struct {
			env  string
			find func() (string, error)
			hint string
		}{{EnvInit, Init, ""}, {EnvCRIU, CRIU, "make criu"}} {
			t.Run(tc.name+"/"+f.env, func(t *testing.T) {
				t.Setenv(f.env, tc.path)
				got, err := f.find()
				switch {
				case tc.ok && (err != nil || got != tc.path):
					t.Fatalf("%s=%s: %q, %v; want it", f.env, tc.path, got, err)
				case !tc.ok && (!errors.Is(err, ErrNotInstalled) || !strings.Contains(err.Error(), f.env) || !strings.Contains(err.Error(), f.hint)):
					t.Fatalf("%s=%s: %q, %v; want ErrNotInstalled naming %s and %q", f.env, tc.path, got, err, f.env, f.hint)
				}
			})
		}
	}
}

// In a checkout, each program is found where make installs it; outside one, the error says
// which make target installs it, and CRIU still names where the wrapper is expected.
func TestFoundInCheckout(t *testing.T) {
	clearEnv(t)
	top := t.TempDir()
	below := filepath.Join(top, "a")
	if err := os.MkdirAll(below, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(top, initInCheckout), 0o755)
	writeFile(t, filepath.Join(top, criuInCheckout), 0o755)
	t.Chdir(below)
	if p, err := Init(); !errors.Is(err, ErrNotInstalled) || !strings.Contains(err.Error(), "make init") {
		t.Fatalf("Init() outside a checkout = %q, %v; want ErrNotInstalled saying make init", p, err)
	}
	if p, err := CRIU(); !errors.Is(err, ErrNotInstalled) || !strings.Contains(err.Error(), "make criu") || p != "" {
		t.Fatalf("CRIU() outside a checkout = %q, %v; want no path and ErrNotInstalled saying make criu", p, err)
	}

	writeFile(t, filepath.Join(top, "go.mod"), 0o644)
	if p, err := Init(); err != nil || p != filepath.Join(top, initInCheckout) {
		t.Fatalf("Init() in a checkout = %q, %v", p, err)
	}
	if p, err := CRIU(); err != nil || p != filepath.Join(top, criuInCheckout) {
		t.Fatalf("CRIU() in a checkout = %q, %v", p, err)
	}
	if err := os.Remove(filepath.Join(top, criuInCheckout)); err != nil {
		t.Fatal(err)
	}
	if p, err := CRIU(); !errors.Is(err, ErrNotInstalled) || p != filepath.Join(top, criuInCheckout) {
		t.Fatalf("CRIU() in a checkout without it = %q, %v; want where make criu puts it and ErrNotInstalled", p, err)
	}
}

// Only the checkout's root is looked in for .cache/postgres, and only a stamped install counts:
// a .cache/postgres/bin up the tree from elsewhere (say under /tmp) is never run.
func TestPostgresOnlyInCheckoutRoot(t *testing.T) {
	clearEnv(t)
	top := t.TempDir()
	fake := filepath.Join(top, postgresInCheckout)
	for _, b := range []string{"initdb", "postgres"} {
		writeFile(t, filepath.Join(fake, b), 0o755)
	}
	writeFile(t, filepath.Join(top, postgresStamp), 0o644)
	below := filepath.Join(top, "a", "b")
	if err := os.MkdirAll(below, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Chdir(below)
	if dirs, _ := PostgresBinDirs(); slices.Contains(dirs, fake) {
		t.Fatalf("found %s above a directory outside any checkout", fake)
	}
	// With a go.mod beside it the same install counts, first, but only once stamped.
	writeFile(t, filepath.Join(top, "go.mod"), 0o644)
	if dirs, err := PostgresBinDirs(); err != nil || dirs[0] != fake {
		t.Fatalf("PostgresBinDirs() in a checkout with a stamped install = %q, %v; want %s first", dirs, err, fake)
	}
	if d := PrivatePostgres(); d != fake {
		t.Fatalf("PrivatePostgres() = %q, want %s", d, fake)
	}
	if err := os.Remove(filepath.Join(top, postgresStamp)); err != nil {
		t.Fatal(err)
	}
	if dirs, _ := PostgresBinDirs(); slices.Contains(dirs, fake) || PrivatePostgres() != "" {
		t.Fatal("an install without its stamp was found")
	}
	// Debian's installs follow, highest major version first.
	want := systemPostgresDirs()
	if dirs, err := PostgresBinDirs(); len(want) > 0 && (err != nil || !slices.Equal(dirs, want)) {
		t.Fatalf("PostgresBinDirs() without a private install = %q, %v; want %q", dirs, err, want)
	}
	if dirs, err := PostgresBinDirs(); len(want) == 0 && (!errors.Is(err, ErrNotInstalled) || !strings.Contains(err.Error(), "make postgres")) {
		t.Fatalf("PostgresBinDirs() with none installed = %q, %v; want ErrNotInstalled saying make postgres", dirs, err)
	}
}

// DELTAGYM_POSTGRES names the one directory, which must hold both binaries.
func TestPostgresNamed(t *testing.T) {
	clearEnv(t)
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "postgres"), 0o755)
	t.Setenv(EnvPostgres, dir)
	if dirs, err := PostgresBinDirs(); !errors.Is(err, ErrNotInstalled) || !strings.Contains(err.Error(), EnvPostgres) {
		t.Fatalf("a directory without initdb: %q, %v; want ErrNotInstalled naming %s", dirs, err, EnvPostgres)
	}
	writeFile(t, filepath.Join(dir, "initdb"), 0o755)
	if dirs, err := PostgresBinDirs(); err != nil || !slices.Equal(dirs, []string{dir}) {
		t.Fatalf("PostgresBinDirs() = %q, %v; want only %s", dirs, err, dir)
	}
}

// A checkout, or a path down to a program in it, that another user could have written is not
// looked in: the server runs what it finds as root.
func TestUntrustedCheckout(t *testing.T) {
	clearEnv(t)
	top := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, filepath.Join(top, "go.mod"), 0o644)
	writeFile(t, filepath.Join(top, criuInCheckout), 0o755)
	t.Chdir(top)
	if p, err := CRIU(); err != nil || p != filepath.Join(top, criuInCheckout) {
		t.Fatalf("CRIU() in a trusted checkout = %q, %v", p, err)
	}
	// A group other than root's: its members are not this user's peers.
	gid := 65534
	if os.Geteuid() != 0 {
		gid = os.Getegid()
	}
	must(os.Chown(filepath.Join(top, ".cache"), -1, gid))
	for _, tc := range []struct {
		name string
		path string
		mode os.FileMode
	}{
		{"a checkout writable by others", top, 0o777},
		{"a directory on the way writable by its group", filepath.Join(top, ".cache"), 0o775},
		{"the program writable by others", filepath.Join(top, criuInCheckout), 0o757},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := os.Stat(tc.path)
			must(err)
			must(os.Chmod(tc.path, tc.mode))
			defer func() { must(os.Chmod(tc.path, st.Mode().Perm())) }()
			if p, err := CRIU(); err == nil {
				t.Fatalf("CRIU() = %q, found where another user could have put it", p)
			}
		})
	}
	if os.Geteuid() == 0 {
		must(os.Chown(filepath.Join(top, "go.mod"), 65534, 65534))
		if p, err := CRIU(); err == nil {
			t.Fatalf("CRIU() = %q, found in a checkout whose go.mod belongs to another user", p)
		}
	}
}
