// Package locate finds the programs deltagym runs besides its own Go code: the sandbox init
// (dg-init), the CRIU wrapper and PostgreSQL's server binaries. The binaries under cmd/ and the
// test helpers call it and put what it finds into the libraries' configs (sandbox.Config,
// pgserver.Config, server.Config); no library looks for a program itself.
//
// Each search takes its environment variable first (DELTAGYM_INIT, DELTAGYM_CRIU,
// DELTAGYM_POSTGRES), then looks where `make` installs: in the checkout holding the working
// executable, then in the checkout holding the working directory. A checkout is the nearest
// directory at or above a path that holds go.mod, and only its root is looked in: a
// .cache/criu or .cache/postgres further up the tree from elsewhere (under /tmp, say) is
// never run. Since the server runs what it finds as root, a checkout and every directory from
// its root down to a program it finds there must belong to this user or root and be writable
// by no one else (but group root): a go.mod another user planted above the working directory is no checkout.
// Errors say which make target installs what is missing.
package locate

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltagym/deltagym/internal/errdefs"
)

// The environment variables that name each program, ahead of any search.
const (
	// EnvInit names the sandbox init (dg-init).
	EnvInit = "DELTAGYM_INIT"
	// EnvCRIU names the CRIU wrapper.
	EnvCRIU = "DELTAGYM_CRIU"
	// EnvPostgres names a directory holding PostgreSQL's initdb and postgres.
	EnvPostgres = "DELTAGYM_POSTGRES"
)

// PostgresMajor is the major version of PostgreSQL that `make postgres` (scripts/postgres.sh)
// installs into the checkout.
const PostgresMajor = 17

// Where make installs, relative to the checkout's root, and where Debian does.
const (
	initInCheckout     = "bin/dg-init"          // make init
	initName           = "dg-init"              // beside bin/deltagym (make build)
	criuInCheckout     = ".cache/criu/bin/criu" // make criu (scripts/criu.sh)
	postgresInCheckout = ".cache/postgres/bin"  // make postgres (scripts/postgres.sh)
	postgresStamp      = ".cache/postgres/.stamp"
	systemPostgres     = "/usr/lib/postgresql/*/bin" // Debian's package postgresql-N
)

// ErrNotInstalled means a program was not found, or what was named is not an executable file.
var ErrNotInstalled = fmt.Errorf("not installed: %w", errdefs.ErrUnavailable)

// Checkout returns the root of the checkout holding the running executable, else of the one
// holding the working directory, or "" outside any (trusted) checkout.
func Checkout() string {
	if roots := checkouts(); len(roots) > 0 {
		return roots[0]
	}
	return ""
}

// checkouts returns the roots of the trusted checkouts holding the running executable and the
// working directory, in that order, each once.
func checkouts() []string {
	var roots []string
	add := func(dir string) {
		r := checkoutRoot(dir)
		if r != "" && (len(roots) == 0 || roots[0] != r) && trusted(r, filepath.Join(r, "go.mod")) == nil {
			roots = append(roots, r)
		}
	}
	if exe, err := os.Executable(); err == nil {
		add(filepath.Dir(exe))
	}
	if wd, err := os.Getwd(); err == nil {
		add(wd)
	}
	return roots
}

// trusted checks that root and every path from it down to p (p below root) belongs to this
// user or root and is writable by no one else (but group root), so that no other user can have
// put p there.
func trusted(root, p string) error {
	rel, err := filepath.Rel(root, p)
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return fmt.Errorf("%s is not below %s", p, root)
	}
	uid := uint32(os.Geteuid())
	cur := root
	for _, part := range append([]string{"."}, strings.Split(rel, string(filepath.Separator))...) {
		cur = filepath.Join(cur, part)
		var st unix.Stat_t
		if err := unix.Stat(cur, &st); err != nil {
			return err
		}
		if st.Uid != uid && st.Uid != 0 {
			return fmt.Errorf("%s belongs to uid %d, neither this user nor root", cur, st.Uid)
		}
		// Group root's members may write: they are root's peers.
		if st.Mode&0o002 != 0 || (st.Mode&0o020 != 0 && st.Gid != 0) {
			return fmt.Errorf("%s is writable by group %d or others (mode %o)", cur, st.Gid, st.Mode&0o7777)
		}
	}
	return nil
}

// inCheckout returns p, under the checkout root, if it is an executable file there that
// trusted admits.
func inCheckout(root, rel string) (string, bool) {
	p := filepath.Join(root, rel)
	return p, Executable(p) == nil && trusted(root, p) == nil
}

// checkoutRoot returns the nearest directory at or above dir that holds go.mod, or "".
func checkoutRoot(dir string) string {
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// Init returns the sandbox init: the file $DELTAGYM_INIT names; else dg-init beside the
// running executable (`make build` puts bin/deltagym and bin/dg-init side by side); else
// bin/dg-init at the root of the checkout (`make init`).
func Init() (string, error) {
	if p := os.Getenv(EnvInit); p != "" {
		return named(EnvInit, p)
	}
	var dirs []string
	if exe, err := os.Executable(); err == nil {
		dirs = append(dirs, filepath.Dir(exe))
		if p := filepath.Join(filepath.Dir(exe), initName); Executable(p) == nil {
			return p, nil
		}
	}
	for _, root := range checkouts() {
		if p, ok := inCheckout(root, initInCheckout); ok {
			return p, nil
		}
	}
	return "", fmt.Errorf("finding the sandbox init: %w: $%s is unset, and there is no %s beside the program (in %s) nor %s in the checkout (run `make init`)",
		ErrNotInstalled, EnvInit, initName, strings.Join(dirs, ", "), initInCheckout)
}

// CRIU returns the CRIU 4.2.1+ wrapper that scripts/criu.sh writes: the file $DELTAGYM_CRIU
// names; else .cache/criu/bin/criu at the root of the checkout (`make criu`). It never takes a
// criu on PATH: Debian 12's 3.17 and trixie's 4.1 do not work on this kernel.
//
// When the wrapper is not there, path is still where it is expected ($DELTAGYM_CRIU, else the
// checkout's; "" outside any checkout) beside the error: a runtime configured with it, which
// checks the wrapper each time it needs one, uses it once `make criu` has installed it.
func CRIU() (path string, err error) {
	if p := os.Getenv(EnvCRIU); p != "" {
		abs, err := named(EnvCRIU, p)
		if err != nil {
			return p, fmt.Errorf("%w (run `make criu` and unset it, or name the wrapper scripts/criu.sh writes)", err)
		}
		return abs, nil
	}
	roots := checkouts()
	for _, root := range roots {
		if p, ok := inCheckout(root, criuInCheckout); ok {
			return p, nil
		}
	}
	err = fmt.Errorf("finding criu: %w: $%s is unset, and there is no %s in the checkout (run `make criu`)",
		ErrNotInstalled, EnvCRIU, criuInCheckout)
	if len(roots) > 0 {
		return filepath.Join(roots[0], criuInCheckout), err
	}
	return "", err
}

// PostgresBinDirs returns directories holding PostgreSQL's initdb and postgres, in order of
// preference: the one $DELTAGYM_POSTGRES names, alone; else the checkout's install of
// PostgreSQL 17 (.cache/postgres/bin, taken only once scripts/postgres.sh has stamped it
// complete) followed by Debian's (/usr/lib/postgresql/N/bin), highest N first.
// pgserver.Config.BinDirs takes the list: a new cluster is made by the first directory, an
// existing one is run by the first of the cluster's own major version.
func PostgresBinDirs() ([]string, error) {
	if d := os.Getenv(EnvPostgres); d != "" {
		abs, err := filepath.Abs(d)
		if err != nil {
			return nil, fmt.Errorf("resolving %s=%s: %w", EnvPostgres, d, err)
		}
		if err := hasPostgres(abs); err != nil {
			return nil, fmt.Errorf("checking %s=%s: %w", EnvPostgres, d, err)
		}
		return []string{abs}, nil
	}
	dirs := InstalledPostgres()
	if len(dirs) == 0 {
		return nil, fmt.Errorf("finding postgres: %w: $%s is unset, there is no %s in the checkout and none in %s (run `make postgres`)",
			ErrNotInstalled, EnvPostgres, postgresInCheckout, systemPostgres)
	}
	return dirs, nil
}

// InstalledPostgres returns the bin directories PostgresBinDirs searches when
// $DELTAGYM_POSTGRES is unset: the checkout's stamped install followed by Debian's, highest
// major version first. It may be empty.
func InstalledPostgres() []string {
	var dirs []string
	if d := PrivatePostgres(); d != "" {
		dirs = append(dirs, d)
	}
	return append(dirs, systemPostgresDirs()...)
}

// PrivatePostgres returns the checkout's stamped install of PostgreSQL 17 (`make postgres`),
// or "" when there is none. It does not look at $DELTAGYM_POSTGRES.
func PrivatePostgres() string {
	for _, root := range checkouts() {
		d := filepath.Join(root, postgresInCheckout)
		if _, err := os.Stat(filepath.Join(root, postgresStamp)); err == nil && hasPostgres(d) == nil &&
			trusted(root, filepath.Join(d, "postgres")) == nil && trusted(root, filepath.Join(d, "initdb")) == nil {
			return d
		}
	}
	return ""
}

// systemPostgresDirs returns Debian's installs of the server that hold both binaries, highest
// major version first.
func systemPostgresDirs() []string {
	type dir struct {
		path  string
		major int
	}
	matches, _ := filepath.Glob(systemPostgres)
	var found []dir
	for _, d := range matches {
		m, err := strconv.Atoi(filepath.Base(filepath.Dir(d)))
		if err == nil && hasPostgres(d) == nil {
			found = append(found, dir{d, m})
		}
	}
	sort.Slice(found, func(i, j int) bool { return found[i].major > found[j].major })
	out := make([]string, len(found))
	for i, d := range found {
		out[i] = d.path
	}
	return out
}

func hasPostgres(dir string) error {
	var errs []error
	for _, b := range []string{"initdb", "postgres"} {
		errs = append(errs, Executable(filepath.Join(dir, b)))
	}
	return errors.Join(errs...)
}

// named checks the file an environment variable names and returns its absolute path.
func named(env, p string) (string, error) {
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", fmt.Errorf("resolving %s=%s: %w", env, p, err)
	}
	if err := Executable(abs); err != nil {
		return "", fmt.Errorf("checking %s=%s: %w", env, p, err)
	}
	return abs, nil
}

// Executable fails, with ErrNotInstalled, unless p is an executable file.
func Executable(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrNotInstalled, err)
	}
	if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%w: %s is not an executable file", ErrNotInstalled, p)
	}
	return nil
}
