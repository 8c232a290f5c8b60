package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/deltagym/deltagym/internal/checkout"
)

// EnvBinDir names the environment variable that says which directory holds the PostgreSQL
// server binaries (initdb, postgres) the private cluster runs with.
const EnvBinDir = "DELTAGYM_POSTGRES"

// binInRepo is where `make postgres` (scripts/postgres.sh) puts PostgreSQL 17's binaries,
// relative to the checkout.
const binInRepo = ".cache/postgres/bin"

// privateMajor is the major version scripts/postgres.sh installs.
const privateMajor = 17

// systemBinDirs matches Debian's installs of the server (package postgresql-N).
const systemBinDirs = "/usr/lib/postgresql/*/bin"

// FindBinDir returns the directory of initdb and postgres: $DELTAGYM_POSTGRES; else
// .cache/postgres/bin (scripts/postgres.sh, which stamps a verified install) at the root of the
// checkout (the directory with go.mod) holding the working directory or the running program;
// else the newest of Debian's own installs (/usr/lib/postgresql/N/bin). Only a checkout's root is
// looked in: a .cache/postgres elsewhere up the tree (under /tmp, say) is never run.
func FindBinDir() (string, error) {
	d, _, err := findBinDir()
	return d, err
}

// findBinDir is FindBinDir; searched is false when the environment named the directory.
func findBinDir() (dir string, searched bool, err error) {
	if d := os.Getenv(EnvBinDir); d != "" {
		abs, err := filepath.Abs(d)
		if err != nil {
			return "", false, fmt.Errorf("resolving %s=%s: %w", EnvBinDir, d, err)
		}
		if err := hasBinaries(abs); err != nil {
			return "", false, fmt.Errorf("checking %s=%s: %w", EnvBinDir, d, err)
		}
		return abs, false, nil
	}
	return findBinDirSearched()
}

// findBinDirSearched is FindBinDir without DELTAGYM_POSTGRES.
func findBinDirSearched() (dir string, searched bool, err error) {
	if d := privateBinDir(); d != "" {
		return d, true, nil
	}
	if d := newestSystemBinDir(); d != "" {
		return d, true, nil
	}
	return "", false, fmt.Errorf("%w: no %s at the checkout's root, none in %s, and %s is unset (run `make postgres`)",
		ErrNoBinaries, binInRepo, systemBinDirs, EnvBinDir)
}

// privateBinDir returns the checkout's stamped .cache/postgres/bin, or "".
func privateBinDir() string {
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if exe, err := os.Executable(); err == nil {
		starts = append(starts, filepath.Dir(exe))
	}
	for _, dir := range starts {
		if root := checkout.Root(dir); root != "" {
			d := filepath.Join(root, binInRepo)
			if _, err := os.Stat(filepath.Join(filepath.Dir(d), ".stamp")); err == nil && hasBinaries(d) == nil {
				return d
			}
		}
	}
	return ""
}

// newestSystemBinDir returns Debian's install of the highest major version, or "".
func newestSystemBinDir() string {
	dirs, _ := filepath.Glob(systemBinDirs)
	best, bestMajor := "", 0
	for _, d := range dirs {
		m, err := strconv.Atoi(filepath.Base(filepath.Dir(d)))
		if err == nil && m > bestMajor && hasBinaries(d) == nil {
			best, bestMajor = d, m
		}
	}
	return best
}

// systemBinDir returns Debian's install of one major version, or "".
func systemBinDir(major int) string {
	d := strings.Replace(systemBinDirs, "*", strconv.Itoa(major), 1)
	if hasBinaries(d) != nil {
		return ""
	}
	return d
}

func hasBinaries(dir string) error {
	for _, b := range []string{"initdb", "postgres"} {
		fi, err := os.Stat(filepath.Join(dir, b))
		if err != nil {
			return fmt.Errorf("looking for %s in %s: %w", b, dir, ErrNoBinaries)
		}
		if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
			return fmt.Errorf("%s in %s is not an executable file: %w", b, dir, ErrNoBinaries)
		}
	}
	return nil
}

var versionLine = regexp.MustCompile(`\(PostgreSQL\) (\d+)`)

// BinaryMajor returns the major version of the postgres binary in dir (17 for 17.12).
func BinaryMajor(ctx context.Context, dir string) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(dir, "postgres"), "-V")
	cmd.Env = []string{"LC_ALL=C", "PATH=/usr/bin:/bin"}
	out, err := cmd.CombinedOutput()
	if err != nil {
		// The private install's binaries name its loader by absolute path: a moved checkout
		// fails here with "no such file or directory".
		return 0, fmt.Errorf("running %s -V (for a checkout's .cache/postgres that was moved, run `make postgres` again): %w: %s",
			filepath.Join(dir, "postgres"), err, bytes.TrimSpace(out))
	}
	m := versionLine.FindSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("%s -V said %q, not a PostgreSQL version", filepath.Join(dir, "postgres"), bytes.TrimSpace(out))
	}
	return strconv.Atoi(string(m[1]))
}

// clusterMajor returns the major version that made the cluster in pgdata (its PG_VERSION), or 0
// when there is no cluster yet.
func clusterMajor(pgdata string) (int, error) {
	b, err := os.ReadFile(filepath.Join(pgdata, "PG_VERSION"))
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("reading the cluster's version: %w", err)
	}
	m, err := strconv.Atoi(string(bytes.TrimSpace(b)))
	if err != nil {
		return 0, fmt.Errorf("%s/PG_VERSION holds %q, not a major version", pgdata, bytes.TrimSpace(b))
	}
	return m, nil
}

// matchBinaries makes sure the binaries can open the cluster in pgdata, and returns their major
// version: a cluster made by another major version cannot be opened. When the bin dir was
// searched for rather than given (in Config.BinDir or DELTAGYM_POSTGRES), Debian's install of the
// cluster's own version is used instead, if there is one (a cluster made before the private
// PostgreSQL 17, by the system's 15, keeps working); otherwise the error says what to do.
func (c *Config) matchBinaries(ctx context.Context, pgdata string) (int, error) {
	got, err := BinaryMajor(ctx, c.BinDir)
	if err != nil {
		return 0, err
	}
	have, err := clusterMajor(pgdata)
	if err != nil || have == 0 || have == got {
		return got, err
	}
	if c.binFound {
		if d := systemBinDir(have); d != "" {
			c.Logger.Warn("private postgres: the cluster was made by another major version; running it with that version's binaries",
				"dir", pgdata, "cluster", have, "bin", d, "found", c.BinDir, "found_version", got)
			c.BinDir = d
			return have, nil
		}
	}
	return 0, fmt.Errorf("%w: the cluster in %s was made by PostgreSQL %d and %s holds PostgreSQL %d (found here: %s); "+
		"install PostgreSQL %d (`make postgres` installs %d) or set %s to its bin directory, or move the cluster away to start a new one (`make clean-ledger` deletes the recorded trajectories)",
		ErrVersion, pgdata, have, c.BinDir, got, installedBinDirs(ctx), have, privateMajor, EnvBinDir)
}

// installedBinDirs lists the bin directories FindBinDir would consider, each with its major
// version: the checkout's private one and Debian's.
func installedBinDirs(ctx context.Context) string {
	dirs, _ := filepath.Glob(systemBinDirs)
	sort.Strings(dirs)
	if d := privateBinDir(); d != "" {
		dirs = append([]string{d}, dirs...)
	}
	var out []string
	for _, d := range dirs {
		if m, err := BinaryMajor(ctx, d); err == nil {
			out = append(out, fmt.Sprintf("%s (%d)", d, m))
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}
